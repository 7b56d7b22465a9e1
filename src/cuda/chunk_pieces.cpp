// How the chunkwise forward splits long sequences into pieces (cuda_chunk_pieces, cuda/cuda.h):
// the model and FLASHDELTA_CHUNK_PIECES. The launches are cuda/chunk.cpp's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/chunk_params.h"
#include "cuda/cuda.h"
#include "cuda/host_params.h"

namespace flashdelta::detail {
namespace {

// `off` runs the forward in one piece, 1, 2, 3, 4 or 8 in that many (at most the chunks);
// unset or `auto` as the model below says.
constexpr const char* kPiecesSetting = "FLASHDELTA_CHUNK_PIECES";

// Pieces: each sequence's chunks split into consecutive runs so that a piece's state kernel
// runs on a second stream beside the next piece's prepare kernel, where the state kernel's
// blocks (one an SM) leave SMs idle. At B = 1, T = 32768, H = 32 on an H100 the prepare
// kernel takes 1.074 ms on every SM, then the state kernel 1.012 ms on 64 of 132
// (bench/NOTES.md (bk)). A piece's state kernel starts from the float32 state the one before
// ended with, through the workspace: the same sums as one launch, bit for bit.
// The model, on a wave of 128 SMs as split_scan's (the same pieces on every GPU): while the
// state kernel runs its blocks = scans x V / 64 (chunk_state_columns), prepare keeps
// r = 1 - blocks / 128 of the chip, and a chunk's state step takes a = kStateOverPrepare /
// scans of the prepare kernel's chip-wide time per chunk (KDA at K = V = 128: 1.012 / 1.074 ms
// at scans = 32). The state kernel does not wait where each piece is q = min(1, r a) times the
// one before; the forward then takes the first piece's prepare plus the whole state kernel:
// at that shape, four pieces of 286, 134, 63 and 29 chunks model 1.61 ms against 2.09.
// Measured on an H100 (bench/NOTES.md (cd)): 2.07-2.09 -> 1.86-1.93 ms, four pieces about as
// fast as eight and faster than two or three; the model leaves out that the state kernels,
// sharing the memory with the prepare kernels beside them, take ~22% longer. Not split
// (auto): fewer than kMinChunks chunks, r below 1/4, or a last piece under kMinPieceChunks
// (fewer pieces first).
constexpr int64_t kPiecesWave = 128, kMinChunks = 32, kMinPieceChunks = 8, kAutoPieces = 4;
constexpr double kStateOverPrepare = 30.0;

// Chunks of `count` pieces of `chunks`, each q times the one before, each at least one chunk.
std::vector<int64_t> geometric_pieces(int64_t count, double q, int64_t chunks) {
  std::vector<double> start(count + 1, 0.0);
  for (int64_t i = 0; i < count; ++i) start[i + 1] = start[i] + std::pow(q, static_cast<double>(i));
  std::vector<int64_t> sizes;
  int64_t begin = 0;
  for (int64_t i = 1; i <= count; ++i) {
    int64_t end = std::llround(static_cast<double>(chunks) * start[i] / start[count]);
    end = std::clamp(end, begin + 1, chunks - (count - i));
    sizes.push_back(end - begin);
    begin = end;
  }
  return sizes;
}

}  // namespace

std::vector<int64_t> cuda_chunk_pieces(int64_t scans, int64_t V, int64_t chunks) {
  constexpr int64_t kColumns = cuda::chunk_state_columns(0);
  const std::string value = env_setting(kPiecesSetting, {"auto", "off", "1", "2", "3", "4", "8"});
  if (chunks <= 1 || scans <= 0 || value == "off") return {chunks};
  const double r = 1.0 - static_cast<double>(scans * ((V + kColumns - 1) / kColumns)) / kPiecesWave,
               q = std::clamp(r * kStateOverPrepare / static_cast<double>(scans), 0.25, 1.0);
  if (!value.empty() && value != "auto")
    return geometric_pieces(std::min<int64_t>(std::stoi(value), chunks), q, chunks);
  if (chunks < kMinChunks || r < 0.25) return {chunks};
  for (int64_t count = kAutoPieces; count > 1; --count) {
    std::vector<int64_t> sizes = geometric_pieces(count, q, chunks);
    if (sizes.back() >= kMinPieceChunks) return sizes;
  }
  return {chunks};
}


}  // namespace flashdelta::detail
