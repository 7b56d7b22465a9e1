// `flashdelta run` without --in: KDA and Gated DeltaNet on a synthetic batch, both fast
// schedules timed and checked against the reference, one table row each.
#pragma once

namespace flashdelta::cli {

// Prints the table; throws Error when an error exceeds its tolerance.
void run_self_check(int threads, int chunk_size);

}  // namespace flashdelta::cli
