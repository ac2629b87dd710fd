#include "tidal/status.h"

namespace tidal {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::Ok: return "Ok";
    case StatusCode::InvalidArgument: return "InvalidArgument";
    case StatusCode::NotFound: return "NotFound";
    case StatusCode::Corruption: return "Corruption";
    case StatusCode::IOError: return "IOError";
    case StatusCode::Busy: return "Busy";
    case StatusCode::Closed: return "Closed";
    case StatusCode::NotReplicated: return "NotReplicated";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (ok()) return "Ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

}  // namespace tidal
