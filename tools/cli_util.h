// Small helpers shared by tidalctl and tidal-demo: strict user-id parsing,
// ISO-8601 timestamps, JSON string escaping, a terminal-aware progress bar
// and fsync of a path. Header-only; uses nothing but the standard library and
// POSIX.
#ifndef TIDAL_TOOLS_CLI_UTIL_H_
#define TIDAL_TOOLS_CLI_UTIL_H_

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace tidal::cli {

// Parses a decimal unsigned 64-bit integer: digits only (no sign, no space,
// not empty), at most 18446744073709551615. Empty optional otherwise.
inline std::optional<std::uint64_t> parse_u64(std::string_view text) {
  if (text.empty()) return std::nullopt;
  std::uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (value > (UINT64_MAX - digit) / 10) return std::nullopt;  // would overflow
    value = value * 10 + digit;
  }
  return value;
}

// "2026-11-29T20:56:18.123456789Z" for `ns` nanoseconds since the Unix epoch.
inline std::string iso8601_utc(std::uint64_t ns) {
  const auto seconds = static_cast<std::time_t>(ns / 1'000'000'000);
  const auto nanos = static_cast<unsigned long>(ns % 1'000'000'000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
  char out[48];
  std::snprintf(out, sizeof out, "%s.%09luZ", date, nanos);
  return out;
}

// `text` as a JSON string literal, quotes included.
inline std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

// Progress of a known amount of work, on stderr. On a terminal it redraws one
// bar line (at most ~10 times a second); otherwise it prints a line every 10%
// when `lines_when_not_tty`, and nothing at all when not.
class ProgressBar {
 public:
  ProgressBar(std::string label, std::uint64_t total, bool lines_when_not_tty)
      : label_(std::move(label)),
        total_(total == 0 ? 1 : total),
        tty_(::isatty(STDERR_FILENO) == 1),
        lines_(lines_when_not_tty),
        start_(Clock::now()),
        last_draw_(start_) {}

  // Reports that `done` of `total` units are finished. Call from one thread.
  void update(std::uint64_t done) {
    if (tty_) {
      const auto now = Clock::now();
      if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      draw(done);
    } else if (lines_) {
      const std::uint64_t decile = done * 10 / total_;
      if (decile > last_decile_) {
        last_decile_ = decile;
        std::fprintf(stderr, "%s: %3llu%% (%llu/%llu)\n", label_.c_str(),
                     static_cast<unsigned long long>(decile * 10), static_cast<unsigned long long>(done),
                     static_cast<unsigned long long>(total_));
      }
    }
  }

  // Draws the final state and ends the bar line.
  void finish(std::uint64_t done) {
    if (!tty_) {
      update(done);  // the last 10% line, if not printed yet
      return;
    }
    draw(done);
    std::fputc('\n', stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;

  void draw(std::uint64_t done) {
    constexpr int kWidth = 30;
    const double fraction = done >= total_ ? 1.0 : static_cast<double>(done) / static_cast<double>(total_);
    const int filled = static_cast<int>(fraction * kWidth);
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.append(static_cast<std::size_t>(kWidth - filled), '.');
    std::fprintf(stderr, "\r%s [%s] %5.1f%% %llu/%llu %.0f/s ", label_.c_str(), bar.c_str(), fraction * 100.0,
                 static_cast<unsigned long long>(done), static_cast<unsigned long long>(total_),
                 secs > 0 ? static_cast<double>(done) / secs : 0.0);
    std::fflush(stderr);
  }

  std::string label_;
  std::uint64_t total_;
  bool tty_;
  bool lines_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
  std::uint64_t last_decile_ = 0;
};

// fsync of a file or directory: "" when it succeeded, else the errno text.
inline std::string fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::strerror(errno);
  const bool ok = ::fsync(fd) == 0;
  const std::string error = ok ? std::string() : std::strerror(errno);
  ::close(fd);
  return error;
}

}  // namespace tidal::cli

#endif  // TIDAL_TOOLS_CLI_UTIL_H_
