// TEMPORARY scaffold, replaced by the reference backward before landing.
#include "reference/reference.h"
namespace flashdelta::detail {
void reference_backward(const Problem&, const BackwardArgs&) {
  throw Error(ErrorCode::unsupported, "backward: scaffold");
}
}  // namespace flashdelta::detail
