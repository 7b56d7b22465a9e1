// Running the built `flashdelta` binary from a test: a scratch directory per test, the
// process with its exit status and captured output, and input files from random cases.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "flashdelta/safetensors.h"
#include "test_util.h"

extern char** environ;

namespace flashdelta::testing {

namespace fs = std::filesystem;

// The binary under test, passed in by CMake ($<TARGET_FILE:flashdelta_cli>).
inline const char* cli_path() { return FLASHDELTA_CLI_PATH; }

struct CliResult {
  int exit_code = -1;  // 128 + signal when the process was killed
  std::string out, err;
};

inline std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

// Runs `flashdelta args...`, its stdout and stderr captured through files in `scratch`.
inline CliResult run_cli(const std::vector<std::string>& args, const fs::path& scratch) {
  const fs::path out_path = scratch / "cli.stdout", err_path = scratch / "cli.stderr";
  std::vector<std::string> argv_strings = {cli_path()};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CliResult r;
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, cli_path(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    r.err = std::string("posix_spawn failed: ") + std::strerror(spawned);
    return r;
  }
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  fs::remove(out_path);
  fs::remove(err_path);
  return r;
}

// A fresh directory per test, removed afterwards.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';
    dir_ = fs::temp_directory_path() / ("flashdelta_cli_" + name + "_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path path(const std::string& name) const { return dir_ / name; }
  CliResult cli(const std::vector<std::string>& args) const { return run_cli(args, dir_); }
  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
    return names;
  }

  fs::path dir_;
};

// An owned copy of a dense view.
inline io::OwnedTensor owned(const TensorView& v) {
  io::OwnedTensor t(v.dtype, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.rank));
  std::memcpy(t.bytes.data(), v.data, t.bytes.size());
  return t;
}

// The input tensors of a case, named as `run --in` reads them; the arguments the case
// passes to forward (Case::args) decide which are present.
inline io::TensorMap case_tensors(const Case& c) {
  HostTensor o = c.make_output(DType::f32);
  const ForwardArgs a = c.args(o, nullptr);
  const std::pair<const char*, const TensorView*> named[] = {{"q", &a.q},
                                                             {"k", &a.k},
                                                             {"v", &a.v},
                                                             {"g", &a.g},
                                                             {"beta", &a.beta},
                                                             {"initial_state", &a.initial_state},
                                                             {"cu_seqlens", &a.cu_seqlens},
                                                             {"A_log", &a.A_log},
                                                             {"dt_bias", &a.dt_bias}};
  io::TensorMap m;
  for (const auto& [name, view] : named)
    if (view->present()) m[name] = owned(*view);
  return m;
}

// The command-line spelling of a case's options.
inline std::vector<std::string> option_flags(const CaseConfig& c) {
  std::vector<std::string> f = {"--mechanism", mechanism_name(c.mechanism)};
  if (c.scale) f.insert(f.end(), {"--scale", std::to_string(*c.scale)});
  if (c.qk_l2norm) f.push_back("--qk-l2norm");
  if (c.beta_sigmoid) f.push_back("--beta-sigmoid");
  if (c.allow_neg_eigval) f.push_back("--allow-neg-eigval");
  if (c.gate_in_kernel) f.push_back("--gate-in-kernel");
  if (c.lower_bound) f.insert(f.end(), {"--lower-bound", std::to_string(*c.lower_bound)});
  if (c.layout == StateLayout::v_first) f.push_back("--state-v-first");
  return f;
}

inline std::vector<double> to_double(io::OwnedTensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  detail::load_row(t.view(), 0, t.numel(), 1, out.data());
  return out;
}

}  // namespace flashdelta::testing
