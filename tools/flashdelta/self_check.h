// `flashdelta run` without --in: KDA and Gated DeltaNet on a synthetic batch, the fast
// schedules timed and checked against the reference, one table row each.
#pragma once

#include <optional>

#include "flashdelta/flashdelta.h"

namespace flashdelta::cli {

// Prints the table; throws Error when an error exceeds its tolerance. `device` runs the fast
// schedules there (every one of that device, or `only`); the reference runs on the CPU.
void run_self_check(int threads, int chunk_size, Device device, std::optional<Schedule> only);

}  // namespace flashdelta::cli
