// Spellings of mechanisms and schedules, shared by the command line and the bindings.
#include <string>

#include "flashdelta/options.h"
#include "flashdelta/types.h"

namespace flashdelta {
namespace {

constexpr Mechanism kMechanisms[] = {Mechanism::linear_attention, Mechanism::simple_gla,
                                     Mechanism::gla,              Mechanism::deltanet,
                                     Mechanism::gated_deltanet,   Mechanism::kda};
constexpr Schedule kSchedules[] = {Schedule::reference, Schedule::recurrent, Schedule::chunk};

}  // namespace

const char* mechanism_name(Mechanism m) {
  switch (m) {
    case Mechanism::linear_attention: return "linear";
    case Mechanism::simple_gla: return "simple_gla";
    case Mechanism::gla: return "gla";
    case Mechanism::deltanet: return "deltanet";
    case Mechanism::gated_deltanet: return "gated_deltanet";
    case Mechanism::kda: return "kda";
  }
  return "?";
}

Mechanism parse_mechanism(std::string_view name) {
  for (Mechanism m : kMechanisms)
    if (name == mechanism_name(m)) return m;
  throw Error(ErrorCode::invalid_argument,
              "argument 'mechanism': expected one of linear, simple_gla, gla, deltanet, "
              "gated_deltanet, kda, got '" + std::string(name) + "'");
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::reference: return "reference";
    case Schedule::recurrent: return "recurrent";
    case Schedule::chunk: return "chunk";
  }
  return "?";
}

Schedule parse_schedule(std::string_view name) {
  for (Schedule s : kSchedules)
    if (name == schedule_name(s)) return s;
  throw Error(ErrorCode::invalid_argument,
              "argument 'schedule': expected one of reference, recurrent, chunk, got '" +
                  std::string(name) + "'");
}

}  // namespace flashdelta
