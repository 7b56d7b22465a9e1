// What the benchmark records about the machine it ran on: CPU model, logical CPUs and the
// last-level cache size, read from /proc/cpuinfo, sysfs and sysconf.
#pragma once

#include <cstdint>
#include <string>

namespace flashdelta::cli {

struct MachineInfo {
  std::string cpu_model;  // "model name" of /proc/cpuinfo, "unknown" when absent
  int logical_cpus = 1;
  int64_t l3_bytes_sysfs = 0;  // /sys/devices/system/cpu/cpu0/cache/index*/ (level 3); 0 = unknown
  int64_t l3_bytes_sysconf = 0;  // sysconf(_SC_LEVEL3_CACHE_SIZE); 0 = unknown

  // The larger of the two reports: virtual machines often disagree (this one: sysfs 32 MiB,
  // sysconf 320 MiB), and a working set meant to miss the cache must exceed both.
  int64_t l3_bytes() const {
    return l3_bytes_sysfs > l3_bytes_sysconf ? l3_bytes_sysfs : l3_bytes_sysconf;
  }
};

MachineInfo read_machine_info();

}  // namespace flashdelta::cli
