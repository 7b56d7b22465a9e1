// The `flashdelta` command line: `run` (a file's forward, or the built-in check), `grad`
// (a file's backward) and `bench`. Exit status: 0 success, 1 invalid input or runtime error (one line on stderr),
// 2 usage error (reported by CLI11).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "bench_command.h"
#include "flashdelta/flashdelta.h"
#include "grad_command.h"
#include "run_command.h"

namespace {

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

int fail(const char* message) {
  std::fprintf(stderr, "flashdelta: error: %s\n", message);
  return kExitError;
}

std::string join_arguments(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) {
    if (i) s += ' ';
    s += argv[i];
  }
  return s;
}

int run_main(int argc, char** argv) {
  CLI::App app{std::string("flashdelta ") + flashdelta::version() +
               ": the delta-rule family of linear attention (linear attention, GLA, DeltaNet, "
               "Gated DeltaNet, KDA)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", flashdelta::version());
  flashdelta::cli::RunFlags run_flags;
  flashdelta::cli::GradFlags grad_flags;
  flashdelta::cli::BenchFlags bench_flags;
  CLI::App* run = flashdelta::cli::add_run_command(app, run_flags);
  CLI::App* grad = flashdelta::cli::add_grad_command(app, grad_flags);
  CLI::App* bench = flashdelta::cli::add_bench_command(app, bench_flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;  // --help and --version exit 0
  }
  if (run->parsed()) flashdelta::cli::run_command(run_flags);
  if (grad->parsed()) flashdelta::cli::grad_command(grad_flags);
  if (bench->parsed()) {
    bench_flags.command_line = join_arguments(argc, argv);
    flashdelta::cli::run_bench(bench_flags);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Nothing escapes: every failure is one line on stderr and exit status 1.
  try {
    return run_main(argc, argv);
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown exception");
  }
}
