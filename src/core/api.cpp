// Public entry points: validate everything, then dispatch to a schedule.
#include <string>

#include "core/problem.h"
#include "cpu/cpu.h"
#include "flashdelta/flashdelta.h"
#include "reference/reference.h"

#ifndef FLASHDELTA_VERSION
#define FLASHDELTA_VERSION "0.0.0"
#endif

namespace flashdelta {
namespace {

using detail::ForwardIO;
using detail::StateView;

void require_cpu(Device device) {
  if (device != Device::cpu)
    throw Error(ErrorCode::unsupported,
                "argument 'q': device cuda is not supported by this build (no CUDA schedules "
                "yet); pass cpu tensors");
}

}  // namespace

void forward(const ForwardArgs& args, const Options& options, Schedule schedule) {
  const detail::Problem p = detail::validate_forward(args, options);
  require_cpu(args.q.device);
  const ForwardIO io{StateView{args.initial_state, options.state_layout},
                     StateView{args.final_state, options.state_layout}, args.o};
  switch (schedule) {
    case Schedule::reference: return detail::reference_forward(p, io);
    case Schedule::recurrent: return detail::cpu_recurrent_forward(p, io);
    case Schedule::chunk: return detail::cpu_chunk_forward(p, io);
  }
}

void decode(const DecodeArgs& args, const Options& options, Schedule schedule) {
  const detail::DecodeProblem d = detail::validate_decode(args, options);
  require_cpu(args.q.device);
  switch (schedule) {
    case Schedule::reference: return detail::reference_decode(d, args.o);
    case Schedule::recurrent: return detail::cpu_recurrent_decode(d, args.o);
    case Schedule::chunk:
      throw Error(ErrorCode::invalid_argument,
                  "argument 'schedule': decode runs the recurrent (or reference) schedule, got "
                  "chunk");
  }
}

void backward(const BackwardArgs& args, const Options& options, Schedule schedule) {
  const detail::Problem p = detail::validate_backward(args, options);
  require_cpu(args.q.device);
  if (schedule != Schedule::reference)
    throw Error(ErrorCode::unsupported,
                std::string("argument 'schedule': the CPU backward exists for the reference "
                            "schedule only, got ") + schedule_name(schedule));
  detail::reference_backward(p, args);
}

const char* version() { return FLASHDELTA_VERSION; }
const char* cpu_simd_target() { return detail::cpu_simd_target_name(); }

}  // namespace flashdelta
