#include "machine_info.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>

namespace flashdelta::cli {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "unknown" : line.substr(start);
  }
  return "unknown";
}

// sysfs sizes read "32768K" (or "32M"); returns bytes, 0 when unreadable.
int64_t parse_cache_size(const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    return 0;
  }
  const char unit = used < text.size() ? text[used] : ' ';
  if (unit == 'K') return value << 10;
  if (unit == 'M') return value << 20;
  if (unit == 'G') return value << 30;
  return value;
}

int64_t l3_from_sysfs() {
  for (int index = 0; index < 8; ++index) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    if (read_line(dir + "level") == "3") return parse_cache_size(read_line(dir + "size"));
  }
  return 0;
}

}  // namespace

MachineInfo read_machine_info() {
  MachineInfo m;
  m.cpu_model = cpu_model();
  m.logical_cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  m.l3_bytes_sysfs = l3_from_sysfs();
#ifdef _SC_LEVEL3_CACHE_SIZE
  m.l3_bytes_sysconf = std::max<long>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
  return m;
}

}  // namespace flashdelta::cli
