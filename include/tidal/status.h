// Status and Result<T>: how every fallible tidal call reports its outcome.
// No exception crosses the tidal API; errors come back as a non-OK Status.
#ifndef TIDAL_STATUS_H_
#define TIDAL_STATUS_H_

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace tidal {

enum class StatusCode {
  Ok,
  InvalidArgument,
  NotFound,
  Corruption,
  IOError,
  Busy,
  Closed,
  // Only with Options::journal_wait: a leave, rejoin or purge that is durable
  // and in effect on this Db, but whose journal entry was not confirmed
  // replicated (Db::confirm_journal) within journal_wait. Not a failure of
  // the call: a retry of the same call is safe and returns OK once the entry
  // is confirmed (docs/CONTRACT.md J4).
  NotReplicated,
};

// Returns "Ok", "InvalidArgument", ... for `code`.
const char* status_code_name(StatusCode code);

// The outcome of a call: OK, or an error code with a message saying what
// failed and where. Cheap to copy when OK.
class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::InvalidArgument, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::NotFound, std::move(msg)}; }
  static Status Corruption(std::string msg) { return {StatusCode::Corruption, std::move(msg)}; }
  static Status IOError(std::string msg) { return {StatusCode::IOError, std::move(msg)}; }
  static Status Busy(std::string msg) { return {StatusCode::Busy, std::move(msg)}; }
  static Status Closed(std::string msg) { return {StatusCode::Closed, std::move(msg)}; }
  static Status NotReplicated(std::string msg) { return {StatusCode::NotReplicated, std::move(msg)}; }

  [[nodiscard]] bool ok() const { return code_ == StatusCode::Ok; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }

  // "Ok" or "<CodeName>: <message>".
  [[nodiscard]] std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::Ok;
  std::string message_;
};

// A T or a non-OK Status (Abseil's StatusOr model). Two programming errors,
// both asserted in debug builds:
//   - accessing the value of a non-OK Result;
//   - building a Result from an OK Status: there is no value to be OK with.
//     A release build keeps the Result non-OK (InvalidArgument, "Result built
//     from an OK Status without a value ...") so that it is never read as a
//     value; fix the caller, which must return a T or an error.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "a Result built from a Status must carry an error");
    if (status_.ok()) {
      status_ = Status::InvalidArgument(
          "Result built from an OK Status without a value (a programming error in the caller)");
    }
  }

  [[nodiscard]] bool ok() const { return status_.ok(); }
  [[nodiscard]] const Status& status() const { return status_; }

  T& value() { assert(ok()); return *value_; }
  const T& value() const { assert(ok()); return *value_; }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace tidal

#endif  // TIDAL_STATUS_H_
