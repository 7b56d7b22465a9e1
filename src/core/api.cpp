// Public entry points: validate everything, then dispatch to a schedule.
#include <string>

#include "core/problem.h"
#include "cpu/cpu.h"
#include "flashdelta/flashdelta.h"
#include "reference/reference.h"
#ifdef FLASHDELTA_WITH_CUDA
#include "cuda/cuda.h"
#endif

#ifndef FLASHDELTA_VERSION
#define FLASHDELTA_VERSION "0.0.0"
#endif

namespace flashdelta {
namespace {

using detail::ForwardIO;
using detail::StateView;

#ifdef FLASHDELTA_WITH_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

// CUDA tensors run the CUDA schedules: recurrent and chunk (the backward: chunk only).
void require_cuda_schedule(Schedule schedule) {
  if (!kBuiltWithCuda)
    throw Error(ErrorCode::unsupported,
                "argument 'q': cuda tensors need a build with CUDA (this one was built "
                "without a CUDA compiler); pass cpu tensors");
  if (schedule == Schedule::reference)
    throw Error(ErrorCode::unsupported,
                "argument 'schedule': the reference schedule runs on cpu tensors only; on cuda "
                "use recurrent or chunk");
}

// The CUDA recurrent kernel keeps its state in registers token by token and has no store
// at chunk starts: per-chunk states come from the chunk schedule.
void require_cuda_outputs(const ForwardArgs& args, Schedule schedule) {
  if (args.chunk_states.present() && schedule == Schedule::recurrent)
    throw Error(ErrorCode::unsupported,
                "argument 'chunk_states': the CUDA recurrent schedule does not record per-chunk "
                "states; use the chunk schedule (or cpu tensors)");
}

}  // namespace

void forward(const ForwardArgs& args, const Options& options, Schedule schedule) {
  const detail::Problem p = detail::validate_forward(args, options);
  const ForwardIO io{StateView{args.initial_state, options.state_layout},
                     StateView{args.final_state, options.state_layout}, args.o,
                     StateView{args.chunk_states, options.state_layout}};
  if (args.q.device == Device::cuda) {
    require_cuda_schedule(schedule);
    require_cuda_outputs(args, schedule);
#ifdef FLASHDELTA_WITH_CUDA
    if (schedule == Schedule::chunk)
      detail::cuda_chunk_forward(p, io, args.stream, args.workspace, args.workspace_bytes);
    else
      detail::cuda_recurrent_forward(p, io, args.stream);
#endif
    return;
  }
  switch (schedule) {
    case Schedule::reference: return detail::reference_forward(p, io);
    case Schedule::recurrent: return detail::cpu_recurrent_forward(p, io);
    case Schedule::chunk: return detail::cpu_chunk_forward(p, io);
  }
}

size_t forward_workspace_bytes(const ForwardArgs& args, const Options& options,
                               Schedule schedule) {
  const detail::Problem p = detail::validate_forward(args, options);
  if (args.q.device != Device::cuda) return 0;
  require_cuda_schedule(schedule);
  require_cuda_outputs(args, schedule);
#ifdef FLASHDELTA_WITH_CUDA
  if (schedule == Schedule::chunk) return static_cast<size_t>(detail::cuda_chunk_workspace_bytes(p));
#endif
  return 0;
}

void decode(const DecodeArgs& args, const Options& options, Schedule schedule) {
  if (schedule == Schedule::chunk)
    throw Error(ErrorCode::invalid_argument,
                "argument 'schedule': decode runs the recurrent (or reference) schedule, got "
                "chunk");
  const detail::DecodeProblem d = detail::validate_decode(args, options);
  if (args.q.device == Device::cuda) {
    require_cuda_schedule(schedule);
#ifdef FLASHDELTA_WITH_CUDA
    detail::cuda_recurrent_decode(d, args.o, args.stream);
#endif
    return;
  }
  if (schedule == Schedule::reference) return detail::reference_decode(d, args.o);
  detail::cpu_recurrent_decode(d, args.o);
}

namespace {

// The CUDA backward runs the chunk schedule only.
void require_cuda_backward_schedule(Schedule schedule) {
  require_cuda_schedule(schedule);
  if (schedule != Schedule::chunk)
    throw Error(ErrorCode::unsupported,
                std::string("argument 'schedule': the CUDA backward runs the chunk schedule, got ") +
                    schedule_name(schedule));
}

}  // namespace

size_t backward_workspace_bytes(const BackwardArgs& args, const Options& options,
                                Schedule schedule) {
  const detail::Problem p = detail::validate_backward(args, options);
  if (args.q.device != Device::cuda) return 0;
  require_cuda_backward_schedule(schedule);
#ifdef FLASHDELTA_WITH_CUDA
  return static_cast<size_t>(
      detail::cuda_chunk_backward_workspace_bytes(p, args.chunk_states.present()));
#else
  return 0;
#endif
}

void backward(const BackwardArgs& args, const Options& options, Schedule schedule) {
  const detail::Problem p = detail::validate_backward(args, options);
  if (args.q.device == Device::cuda) {
    require_cuda_backward_schedule(schedule);
#ifdef FLASHDELTA_WITH_CUDA
    detail::cuda_chunk_backward(p, args);
#endif
    return;
  }
  if (schedule != Schedule::reference)
    throw Error(ErrorCode::unsupported,
                std::string("argument 'schedule': the CPU backward exists for the reference "
                            "schedule only, got ") + schedule_name(schedule));
  detail::reference_backward(p, args);
}

const char* version() { return FLASHDELTA_VERSION; }
const char* cpu_simd_target() { return detail::cpu_simd_target_name(); }

}  // namespace flashdelta
