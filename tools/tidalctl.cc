// tidalctl: inspect and administer a tidal Db from the shell, modelled on
// RocksDB's ldb, and a global view (view PATH ...). Uses only the public API
// (<tidal/db.h>, <tidal/global_view.h>).
//
// Read-only commands open with Options::read_only, so they work while a host
// service holds the Db; write commands need the Db to themselves.
// Exit codes: 0 success, 1 the operation failed (or found problems),
// 2 bad usage (nothing was opened, created or changed).
#include <tidal/db.h>
#include <tidal/global_view.h>
#include <tidal/metrics.h>
#ifdef TIDAL_HAVE_NATS
#include <tidal/nats.h>
#endif
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstdio>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cli_util.h"

namespace {

using tidal::cli::iso8601_utc;
using tidal::cli::json_string;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

constexpr char kUsage[] = R"(Usage: tidalctl --db PATH [--json] COMMAND [ARGS]
       tidalctl [--json] view PATH applied | cohort ID ITEM | community ID ITEM

Read-only commands (work while a host service holds the Db open):
  status USER      the user's community-layer status, last leave time and communities
  history USER     every leave and rejoin of the user, oldest first
  list-left        every Left user with left_at_ns, in user order (for purge pipelines)
  stats            Db::stats() of a fresh read-only open: only what open rebuilds
                   is meaningful (users_left, corrupt_records_treated_as_left);
                   the traffic counters count since this open, so they read 0.
                   A host exports live counters from its own Db handle.
  verify           decode every record and cross-check the index; prints one
                   line per problem naming the key, exit 1 if any
  receipts USER    every purge receipt of the user, oldest first
  rematerialize    recompute every cohort and community aggregate from the
                   contribution ledger and compare exactly; one line per
                   mismatch (key, stored, recomputed), exit 1 if any
  changes          the change feed: shard id, last seq, trim point and the
                   payload bytes not yet trimmed ("off" without a feed)

Write commands (need the Db to themselves; fail with exit 1 while it is held):
  leave USER       leave the community layer (durable on return; no-op if Left)
  rejoin USER      rejoin the community layer (keeps the history; no-op if Active)
  purge USER       remove every contribution of a Left user from the shared
                   aggregates, erase their ledger and print the receipt
  rematerialize --repair
                   as rematerialize, and rewrite each mismatching aggregate
                   from the ledger (one synced batch)
  rotate-key FILE  wrap every bucket key with the key-encryption key in FILE
                   (as --key-file reads it) in one synced write, leaving no
                   file with a value the old key (--key-file) wrapped; every
                   later open needs FILE's key
  backup DIR [--keep N]
                   a consistent copy of the Db (both engines, hard links where
                   the file system allows) into DIR/<UTC time>; with --keep N,
                   then delete all but the N newest backups in DIR (old
                   backups still hold what later purges erased: keep few)
  restore BACKUP   make --db PATH (which must not exist) a copy of BACKUP (table
                   files hard-linked, the rest copied, made durable in
                   PATH.tidal-restore-tmp and renamed to PATH when whole;
                   refused first when PATH's file system lacks the room for
                   the files it copies; BACKUP stays usable). The
                   Db is then recovering: it refuses signals and user-status
                   calls until the privacy journal's entries after the backup
                   are replayed and finish-recovery runs
  restore BACKUP --nats SERVERS [--journal-stream NAME] [--journal-subject-prefix P]
                   the whole recovery: the copy, then the journal's entries
                   after the backup read from the journal's JetStream stream
                   (default TIDAL_JOURNAL, tidal.journal) and replayed, then
                   finish-recovery; the Db serves again on success and stays
                   recovering on any failure (a missing journal range is named)
  finish-recovery  end a recovery: re-seed the change feed (views replace the
                   shard's contribution) and serve again. Only after the
                   journal was replayed: leaves and purges made after the
                   backup are otherwise forgotten
  reseed           re-seed the change feed: a new incarnation whose first batches
                   are a snapshot of the shard's shared aggregates; every view
                   replaces the shard's contribution once it applies them (watch
                   with 'view PATH applied': the shard shows the new incarnation)
  migrate          upgrade a Db written by tidal 0.2 (format 2, one RocksDB
                   database) or 0.3 (format 3) to format 4 (users and state
                   engines, the ledger sealed per user); crash-safe, and what
                   any writable open does anyway
  leave --from FILE, rejoin --from FILE, purge --from FILE
                   one user id per line (FILE '-' reads stdin); blank lines and
                   lines starting with '#' are skipped; bad lines are reported
                   with their line number and skipped, the good ones applied

Global view (PATH is a GlobalView's directory, opened read-only: works while a
host service holds it; nothing is created or written):
  view PATH applied            every shard's applied seq and incarnation, in shard order
  view PATH cohort ID ITEM     the cohort's score of ITEM, summed over every shard
  view PATH community ID ITEM  the community's score of ITEM, summed over every shard

Options:
  --db PATH        the Db directory (required; never created)
  --json           machine output: one JSON object (list-left: one per line)
  --prometheus     with stats or view PATH applied: the Prometheus text format
                   (tidal_db_* / tidal_view_*, labelled db="PATH" or view="PATH")
  --from FILE      bulk input for leave/rejoin/purge
  --repair         with rematerialize: rewrite the mismatching aggregates
  --strict-erasure with purge: Options::strict_erasure (also compact away the
                   purged users' cells' older versions; docs/PURGE.md)
  --keep N         with backup: how many backups to keep in DIR (N >= 1)
  --key-file PATH  the Db's key-encryption key (Options::key_encryption_key):
                   a file of exactly 32 bytes, or of 64 hex digits (a final
                   newline allowed); read at the open. Needed by every
                   command on a Db whose bucket keys are wrapped; a write
                   command on a Db without one wraps them with it
  -h, --help       this help

USER is an unsigned 64-bit decimal integer (0..18446744073709551615).
Timestamps are ns since the Unix epoch, shown with their ISO-8601 UTC form.
Exit codes: 0 ok; 1 the operation failed, verify found problems or a bulk
file had bad lines; 2 bad usage or a path that is not a tidal Db.
)";

struct Command {
  std::string_view name;
  bool takes_user;  // status, history, leave, rejoin, purge, receipts
  bool writes;      // leave, rejoin, purge (and rematerialize --repair)
};

constexpr Command kCommands[] = {
    {"status", true, false},    {"history", true, false}, {"list-left", false, false}, {"stats", false, false},
    {"verify", false, false},   {"leave", true, true},    {"rejoin", true, true},
    {"purge", true, true},      {"receipts", true, false}, {"rematerialize", false, false},
    {"view", false, false},  // view PATH ...: a GlobalView, not a Db (cmd_view)
    {"changes", false, false},  {"migrate", false, true},    {"reseed", false, true},
    {"backup", false, true},    {"restore", false, false},   {"finish-recovery", false, true},
    {"rotate-key", false, true},
};

struct Args {
  std::optional<std::string> db;
  std::optional<std::string> from;
  bool json = false;
  bool prometheus = false;
  bool help = false;
  bool repair = false;
  bool strict_erasure = false;          // purge --strict-erasure
  std::optional<std::uint64_t> keep;    // backup --keep N
  std::optional<std::string> key_file;  // --key-file PATH
  // restore --nats SERVERS [--journal-stream NAME] [--journal-subject-prefix PREFIX]
  std::optional<std::string> nats, journal_stream, journal_subject_prefix;
  std::vector<std::string> positional;  // command, then its operands
};

int usage_error(const std::string& what) {
  std::fprintf(stderr, "tidalctl: %s\nRun 'tidalctl --help' for usage.\n", what.c_str());
  return kExitUsage;
}

std::string invalid_user_text(std::string_view text) {
  return "invalid user id '" + std::string(text) +
         "': expected an unsigned 64-bit decimal integer (digits only, 0..18446744073709551615)";
}

// Fills `args`; returns an error message for a malformed command line.
std::optional<std::string> parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value_of = [&](std::string_view name) -> std::optional<std::string> {
      // "--name VALUE" or "--name=VALUE"; nullopt when the value is missing.
      if (arg.size() > name.size() && arg[name.size()] == '=') return std::string(arg.substr(name.size() + 1));
      if (i + 1 >= argc) return std::nullopt;
      return std::string(argv[++i]);
    };
    auto is = [&](std::string_view name) {
      return arg == name || (arg.starts_with(name) && arg.size() > name.size() && arg[name.size()] == '=');
    };
    if (arg == "-h" || arg == "--help") {
      args->help = true;
    } else if (arg == "--json") {
      args->json = true;
    } else if (arg == "--prometheus") {
      args->prometheus = true;
    } else if (arg == "--repair") {
      args->repair = true;
    } else if (arg == "--strict-erasure") {
      args->strict_erasure = true;
    } else if (is("--db")) {
      args->db = value_of("--db");
      if (!args->db || args->db->empty()) return "--db needs a PATH";
    } else if (is("--from")) {
      args->from = value_of("--from");
      if (!args->from || args->from->empty()) return "--from needs a FILE (or '-' for stdin)";
    } else if (is("--key-file")) {
      args->key_file = value_of("--key-file");
      if (!args->key_file || args->key_file->empty()) return "--key-file needs a PATH";
    } else if (is("--keep")) {
      std::optional<std::string> v = value_of("--keep");
      args->keep = v ? tidal::cli::parse_u64(*v) : std::nullopt;
      if (!args->keep || *args->keep == 0) return "--keep needs a number of backups, at least 1";
    } else if (is("--nats") || is("--journal-stream") || is("--journal-subject-prefix")) {
      const std::string name(arg.substr(0, arg.find('=')));
      std::optional<std::string> v = value_of(name);
      if (!v || v->empty()) return name + (name == "--nats" ? " needs the cluster's URLs" : " needs a NAME");
      (name == "--nats" ? args->nats : name == "--journal-stream" ? args->journal_stream : args->journal_subject_prefix) = v;
    } else if (arg.starts_with("--")) {
      return "unknown option '" + std::string(arg) + "'";
    } else {
      args->positional.emplace_back(arg);  // "-5" lands here and fails as a user id
    }
  }
  return std::nullopt;
}

std::string status_name(tidal::MembershipStatus s) {
  return s == tidal::MembershipStatus::Left ? "Left" : "Active";
}

std::string json_u64(std::optional<std::uint64_t> v) { return v ? std::to_string(*v) : "null"; }
std::string json_time(std::optional<std::uint64_t> v) { return v ? json_string(iso8601_utc(*v)) : "null"; }
std::string text_u64(std::optional<std::uint64_t> v) { return v ? std::to_string(*v) : "-"; }
std::string text_time(std::optional<std::uint64_t> v) { return v ? iso8601_utc(*v) : "-"; }

// Reports a failed Db call on stderr; returns exit code 1.
int db_failure(std::string_view what, const tidal::Status& s) {
  std::fprintf(stderr, "tidalctl: %.*s failed: %s\n", static_cast<int>(what.size()), what.data(),
               s.to_string().c_str());
  return kExitFailed;
}

// ---- read-only commands ----

int cmd_status(tidal::Db& db, std::uint64_t user, bool json) {
  tidal::Result<tidal::CommunityMembership> m = db.community_layer_status(user);
  if (!m.ok()) return db_failure("status", m.status());
  tidal::Result<std::vector<std::uint64_t>> communities = db.communities_of(user);
  if (!communities.ok()) return db_failure("status", communities.status());
  std::string list;
  for (std::uint64_t c : *communities) list += (list.empty() ? "" : (json ? "," : ", ")) + std::to_string(c);
  if (json) {
    std::printf("{\"user_id\":%llu,\"status\":\"%s\",\"left_at_ns\":%s,\"left_at\":%s,\"communities\":[%s]}\n",
                static_cast<unsigned long long>(user), status_name(m->status).c_str(), json_u64(m->left_at_ns).c_str(),
                json_time(m->left_at_ns).c_str(), list.c_str());
  } else {
    std::printf("user_id      %llu\nstatus       %s\nleft_at_ns   %s\nleft_at      %s\ncommunities  %s\n",
                static_cast<unsigned long long>(user), status_name(m->status).c_str(),
                text_u64(m->left_at_ns).c_str(), text_time(m->left_at_ns).c_str(),
                list.empty() ? "-" : list.c_str());
  }
  return kExitOk;
}

int cmd_history(tidal::Db& db, std::uint64_t user, bool json) {
  tidal::Result<std::vector<tidal::MembershipEvent>> events = db.community_layer_history(user);
  if (!events.ok()) return db_failure("history", events.status());
  auto event_name = [](const tidal::MembershipEvent& e) {
    return e.status == tidal::MembershipStatus::Left ? "leave" : "rejoin";
  };
  if (json) {
    std::string items;
    for (const tidal::MembershipEvent& e : *events) {
      if (!items.empty()) items += ',';
      items += "{\"event\":\"" + std::string(event_name(e)) + "\",\"status\":\"" + status_name(e.status) +
               "\",\"at_ns\":" + std::to_string(e.at_ns) + ",\"at\":" + json_string(iso8601_utc(e.at_ns)) + "}";
    }
    std::printf("{\"user_id\":%llu,\"events\":[%s]}\n", static_cast<unsigned long long>(user), items.c_str());
    return kExitOk;
  }
  if (events->empty()) {
    std::printf("user %llu: no leave or rejoin recorded\n", static_cast<unsigned long long>(user));
    return kExitOk;
  }
  std::printf("%-4s  %-6s  %-19s  %s\n", "#", "event", "at_ns", "at");
  int n = 0;
  for (const tidal::MembershipEvent& e : *events) {
    std::printf("%-4d  %-6s  %-19llu  %s\n", ++n, event_name(e), static_cast<unsigned long long>(e.at_ns),
                iso8601_utc(e.at_ns).c_str());
  }
  return kExitOk;
}

int cmd_list_left(tidal::Db& db, bool json) {
  std::uint64_t count = 0;
  if (!json) std::printf("%-20s  %-19s  %s\n", "user_id", "left_at_ns", "left_at");
  tidal::Status s = db.for_each_left([&](const tidal::CommunityMembership& m) {
    ++count;
    if (json) {
      std::printf("{\"user_id\":%llu,\"left_at_ns\":%s,\"left_at\":%s}\n", static_cast<unsigned long long>(m.user_id),
                  json_u64(m.left_at_ns).c_str(), json_time(m.left_at_ns).c_str());
    } else {
      std::printf("%-20llu  %-19s  %s\n", static_cast<unsigned long long>(m.user_id), text_u64(m.left_at_ns).c_str(),
                  text_time(m.left_at_ns).c_str());
    }
    return true;
  });
  if (!s.ok()) return db_failure("list-left", s);
  if (!json) std::printf("(%llu users Left)\n", static_cast<unsigned long long>(count));
  return kExitOk;
}

int cmd_changes(tidal::Db& db, bool json) {
  const tidal::Stats st = db.stats();
  if (json) {
    if (!st.change_feed) {
      std::printf("{\"change_feed\":false}\n");
    } else {
      std::printf("{\"change_feed\":true,\"shard_id\":%llu,\"last_seq\":%llu,\"trimmed_seq\":%llu,\"pending_bytes\":%llu,"
                  "\"incarnation\":\"%s\"}\n",
                  static_cast<unsigned long long>(st.change_feed_shard_id),
                  static_cast<unsigned long long>(st.change_feed_last_seq),
                  static_cast<unsigned long long>(st.change_feed_trimmed_seq),
                  static_cast<unsigned long long>(st.change_feed_pending_bytes), st.change_feed_incarnation.c_str());
    }
    return kExitOk;
  }
  if (!st.change_feed) {
    std::printf("change_feed    off (the Db keeps no change feed)\n");
    return kExitOk;
  }
  std::printf("change_feed    on\nshard_id       %llu\nlast_seq       %llu\ntrimmed_seq    %llu\npending_bytes  %llu\n"
              "incarnation    %s\n",
              static_cast<unsigned long long>(st.change_feed_shard_id),
              static_cast<unsigned long long>(st.change_feed_last_seq),
              static_cast<unsigned long long>(st.change_feed_trimmed_seq),
              static_cast<unsigned long long>(st.change_feed_pending_bytes), st.change_feed_incarnation.c_str());
  return kExitOk;
}

// The backups in `root`, oldest first: subdirectories whose names sort by
// time (backup names them by UTC time) holding a backup manifest.
std::vector<std::string> backups_in(const std::string& root) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    if (e.is_directory(ec) && std::filesystem::exists(e.path() / "TIDAL_BACKUP", ec)) {
      names.push_back(e.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

int cmd_backup(tidal::Db& db, const std::string& root, std::optional<std::uint64_t> keep, bool json) {
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) {
    std::fprintf(stderr, "tidalctl: backup: '%s' is not a directory (create it first)\n", root.c_str());
    return kExitFailed;
  }
  // UTC time to the millisecond: names sort by age.
  const auto now = std::chrono::system_clock::now();
  const auto ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count());
  std::string name = iso8601_utc(ns);
  std::replace(name.begin(), name.end(), ':', '-');
  const std::string dir = (std::filesystem::path(root) / name).string();
  const auto start = std::chrono::steady_clock::now();
  if (tidal::Status s = db.backup(dir); !s.ok()) return db_failure("backup", s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string files = "copied";
  {
    std::ifstream manifest(dir + "/TIDAL_BACKUP");
    for (std::string line; std::getline(manifest, line);) {
      if (line.rfind("files ", 0) == 0) files = line.substr(6);
    }
  }
  std::vector<std::string> deleted;
  if (keep) {
    std::vector<std::string> all = backups_in(root);
    for (std::size_t i = 0; i + *keep < all.size(); ++i) {
      std::filesystem::remove_all(std::filesystem::path(root) / all[i], ec);
      if (ec) {
        std::fprintf(stderr, "tidalctl: backup: deleting the old backup '%s' failed: %s\n",
                     (std::filesystem::path(root) / all[i]).c_str(), ec.message().c_str());
        return kExitFailed;
      }
      deleted.push_back(all[i]);
    }
  }
  if (json) {
    std::string list;
    for (const std::string& d : deleted) {
      if (!list.empty()) list += ',';  // piece by piece: GCC 12's false -Wrestrict (see cmd_stats)
      list += json_string(d);
    }
    std::printf("{\"action\":\"backup\",\"dir\":%s,\"files\":%s,\"seconds\":%.3f,\"deleted\":[%s]}\n",
                json_string(dir).c_str(), json_string(files).c_str(), seconds, list.c_str());
  } else {
    std::printf("backup: %s (files %s, %.3f s)\n", dir.c_str(), files.c_str(), seconds);
    for (const std::string& d : deleted) std::printf("deleted old backup: %s\n", d.c_str());
  }
  return kExitOk;
}

// Table files hard-linked (immutable), every other file copied (RocksDB
// appends to its MANIFEST and logs, which must stay the backup's own).
// Opens the Db at `path`. A Db with a change feed or a privacy journal: a
// write must go into them too. Their shard id, which the refusal names (a
// read-only open would refuse a format-2 Db, and the refused open did not
// upgrade it), then the writable open with them (the feed is checked first,
// then the journal).
// A key-encryption key from `file`: exactly 32 bytes, or 64 hex digits
// (a final newline allowed). InvalidArgument naming the file otherwise.
tidal::Result<std::string> read_key_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return tidal::Status::InvalidArgument("cannot read the key file '" + file + "'");
  std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (bytes.size() == 32) return bytes;
  std::string_view hex(bytes);
  if (hex.ends_with('\n')) hex.remove_suffix(1);
  if (hex.ends_with('\r')) hex.remove_suffix(1);
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string key;
  if (hex.size() == 64) {
    for (std::size_t i = 0; i < 64; i += 2) {
      const int hi = digit(hex[i]), lo = digit(hex[i + 1]);
      if (hi < 0 || lo < 0) break;
      key.push_back(static_cast<char>(hi << 4 | lo));
    }
  }
  std::fill(bytes.begin(), bytes.end(), '\0');
  if (key.size() == 32) return key;
  return tidal::Status::InvalidArgument("the key file '" + file +
                                        "' holds neither 32 bytes nor 64 hex digits (a key-encryption key is AES-256)");
}

tidal::Result<std::unique_ptr<tidal::Db>> open_db(const std::string& path, tidal::Options options) {
  tidal::Result<std::unique_ptr<tidal::Db>> opened = tidal::Db::open(path, options);
  for (int attempt = 0; attempt < 2 && !opened.ok() && !options.read_only &&
                        opened.status().code() == tidal::StatusCode::InvalidArgument;
       ++attempt) {
    const std::string& message = opened.status().message();
    const bool feed = message.find("keeps a change feed") != std::string::npos;
    const bool journal = message.find("keeps a privacy journal") != std::string::npos;
    if (!feed && !journal) break;
    const std::string marker = "shard_id = ";
    std::uint64_t shard = 0;
    const std::size_t at = message.rfind(marker);
    if (at == std::string::npos ||
        std::from_chars(message.data() + at + marker.size(), message.data() + message.size(), shard).ec != std::errc()) {
      break;
    }
    (feed ? options.change_feed : options.journal) = true;
    options.shard_id = shard;
    opened = tidal::Db::open(path, options);
  }
  return opened;
}

// restore --nats: the copy at `path` gets the privacy journal's entries after
// its backup from the journal's stream, then serves again
// (tidal::nats::recover_shard). On failure the copy stays recovering.
int replay_journal(const std::string& backup, const std::string& path, const Args& args, std::uint64_t linked,
                   std::uint64_t copied) {
#ifdef TIDAL_HAVE_NATS
  const auto start = std::chrono::steady_clock::now();
  tidal::Options options;
  options.create_if_missing = false;
  if (args.key_file) options.key_encryption_key = [file = *args.key_file] { return read_key_file(file); };
  tidal::Result<std::unique_ptr<tidal::Db>> opened = open_db(path, options);
  if (!opened.ok()) return db_failure("restore: opening the copy at '" + path + "'", opened.status());
  tidal::Db& db = **opened;
  const tidal::Stats before = db.stats();
  if (!before.journal) {
    std::fprintf(stderr,
                 "tidalctl: restore: the backup '%s' keeps no privacy journal (it was made without "
                 "Options::journal): there is nothing to replay from NATS. '%s' is recovering: re-apply the leaves "
                 "and purges made since the backup, then run finish-recovery\n",
                 backup.c_str(), path.c_str());
    return kExitFailed;
  }
  tidal::nats::Config config;
  config.servers = *args.nats;
  if (args.journal_stream) config.journal_stream = *args.journal_stream;
  if (args.journal_subject_prefix) config.journal_subject_prefix = *args.journal_subject_prefix;
  if (tidal::Status s = tidal::nats::recover_shard(&db, config); !s.ok()) {
    std::fprintf(stderr,
                 "tidalctl: restore: %s\n'%s' is still recovering (it serves nothing): fix the cause, delete it and "
                 "run the restore again\n",
                 s.to_string().c_str(), path.c_str());
    return kExitFailed;
  }
  const tidal::Stats after = db.stats();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto n = [](std::uint64_t v) { return static_cast<unsigned long long>(v); };
  if (args.json) {
    std::printf("{\"action\":\"restore\",\"db\":%s,\"linked\":%llu,\"copied\":%llu,\"recovering\":false,"
                "\"shard_id\":%llu,\"journal_stream\":%s,\"replayed\":%llu,\"journal_last_seq\":%llu,"
                "\"incarnation\":%s,\"seconds\":%.3f}\n",
                json_string(path).c_str(), n(linked), n(copied), n(after.journal_shard_id),
                json_string(config.journal_stream).c_str(), n(after.journal_last_seq - before.journal_last_seq),
                n(after.journal_last_seq), json_string(after.change_feed_incarnation).c_str(), seconds);
  } else {
    std::printf("restore: %s is a copy of %s (%llu files linked, %llu copied).\n"
                "replayed %llu journal entries of shard %llu (seqs %llu..%llu) from stream %s; ",
                path.c_str(), backup.c_str(), n(linked), n(copied), n(after.journal_last_seq - before.journal_last_seq),
                n(after.journal_shard_id), n(before.journal_last_seq + 1), n(after.journal_last_seq),
                config.journal_stream.c_str());
    if (after.change_feed) std::printf("change feed re-seeded as incarnation %s; ", after.change_feed_incarnation.c_str());
    std::printf("the Db serves again (%.2f s after the copy).\n", seconds);
  }
  return kExitOk;
#else
  (void)linked, (void)copied, (void)args;
  std::fprintf(stderr, "tidalctl: restore --nats: this tidalctl was built without tidal::nats (TIDAL_BUILD_NATS=OFF); "
               "'%s' is a copy of '%s' and recovering\n", path.c_str(), backup.c_str());
  return kExitFailed;
#endif
}

int cmd_restore(const std::string& backup, const std::string& path, const Args& args) {
  const bool json = args.json;
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(fs::path(backup) / "TIDAL_BACKUP", ec)) {
    std::fprintf(stderr, "tidalctl: restore: '%s' is not a tidal backup (no TIDAL_BACKUP manifest)\n", backup.c_str());
    return kExitUsage;
  }
  if (fs::exists(fs::symlink_status(path, ec))) {
    std::fprintf(stderr, "tidalctl: restore: '%s' already exists; restore into a new directory\n", path.c_str());
    return kExitUsage;
  }
  // What the backup holds, in one walk: its directories (before what they
  // hold) and files, with their sizes.
  struct Entry {
    fs::path from;
    bool directory;
    std::uintmax_t size;
  };
  std::vector<Entry> entries;
  for (auto it = fs::recursive_directory_iterator(backup, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const bool directory = it->is_directory(ec);
    entries.push_back({it->path(), directory, directory ? 0 : it->file_size(ec)});
  }
  if (ec) {
    std::fprintf(stderr, "tidalctl: restore: reading '%s' failed: %s\n", backup.c_str(), ec.message().c_str());
    return kExitFailed;
  }
  // Room first: the bytes copied (every file but the table files, which are
  // hard-linked when BACKUP is on PATH's file system), with 1 % and 1 MiB
  // to spare, must be free where PATH goes.
  {
    const fs::path parent = fs::absolute(fs::path(path), ec).lexically_normal().parent_path();
    struct stat at {}, from {};
    const bool same_fs =
        ::stat(parent.c_str(), &at) == 0 && ::stat(backup.c_str(), &from) == 0 && at.st_dev == from.st_dev;
    std::uintmax_t need = 0;
    for (const Entry& e : entries) {
      if (!e.directory && !(same_fs && e.from.extension() == ".sst")) need += e.size;
    }
    need += need / 100 + (1u << 20);
    const fs::space_info room = fs::space(parent, ec);
    if (!ec && room.available < need) {
      std::fprintf(stderr,
                   "tidalctl: restore: '%s' needs %ju bytes free in '%s' (the files it copies, and 1 %% and 1 MiB "
                   "to spare); %ju are: free some, or restore onto another file system\n",
                   path.c_str(), need, parent.c_str(), room.available);
      return kExitFailed;
    }
    ec.clear();
  }
  // The copy is made in `staging`, made durable, and renamed to `path`
  // once whole: a restore killed mid-copy never leaves `path` holding the
  // engines without the manifest (it would open as a Db that is not
  // recovering and serve the backup's state without the journal's replay).
  const std::string staging = path + ".tidal-restore-tmp";
  if (fs::exists(fs::symlink_status(staging, ec))) {
    fs::remove_all(staging, ec);  // what a killed restore into `path` left
    if (ec) {
      std::fprintf(stderr, "tidalctl: restore: removing '%s' (left by a restore that was killed) failed: %s\n",
                   staging.c_str(), ec.message().c_str());
      return kExitFailed;
    }
  }
  // Tests only: SIGKILL before the n-th file is copied, or ("rename") before
  // the copy is renamed into place (tools/tests/cli_test.sh).
  const char* kill_at = std::getenv("TIDAL_TEST_KILL_RESTORE_AT");
  const auto maybe_kill = [kill_at](const std::string& step) {
    if (kill_at != nullptr && step == kill_at) ::raise(SIGKILL);
  };
  std::uint64_t linked = 0, copied = 0;
  std::vector<fs::path> written{staging};  // what is fsynced before the rename
  fs::create_directories(staging, ec);
  for (std::size_t i = 0; !ec && i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const fs::path to = fs::path(staging) / fs::relative(e.from, backup, ec);
    written.push_back(to);
    if (e.directory) {
      fs::create_directories(to, ec);
      continue;
    }
    maybe_kill(std::to_string(linked + copied + 1));
    if (e.from.extension() == ".sst") {
      fs::create_hard_link(e.from, to, ec);
      if (!ec) {
        ++linked;
        continue;
      }
      ec.clear();
    }
    fs::copy_file(e.from, to, ec);
    ++copied;
  }
  std::string failed = ec ? ec.message() : std::string();
  // Files first, then their directories (deepest first), then the parent
  // after the rename.
  for (auto p = written.rbegin(); failed.empty() && p != written.rend(); ++p) {
    if (std::string error = tidal::cli::fsync_path(p->string()); !error.empty()) {
      failed = "fsync of '" + p->string() + "': " + error;
    }
  }
  if (failed.empty()) {
    maybe_kill("rename");
    fs::rename(staging, path, ec);
    if (ec) failed = "renaming '" + staging + "' to '" + path + "': " + ec.message();
  }
  if (failed.empty()) {
    const fs::path parent = fs::absolute(fs::path(path), ec).lexically_normal().parent_path();
    if (std::string error = tidal::cli::fsync_path(parent.string()); !error.empty()) {
      failed = "fsync of '" + parent.string() + "': " + error;
    }
  }
  if (!failed.empty()) {
    std::fprintf(stderr, "tidalctl: restore of '%s' into '%s' failed: %s\n", backup.c_str(), path.c_str(),
                 failed.c_str());
    fs::remove_all(staging, ec);
    return kExitFailed;
  }
  if (args.nats) return replay_journal(backup, path, args, linked, copied);
  if (json) {
    std::printf("{\"action\":\"restore\",\"db\":%s,\"linked\":%llu,\"copied\":%llu,\"recovering\":true}\n",
                json_string(path).c_str(), static_cast<unsigned long long>(linked),
                static_cast<unsigned long long>(copied));
  } else {
    std::printf("restore: %s is a copy of %s (%llu files linked, %llu copied). It is recovering: replay the privacy\n"
                "journal's entries after the backup (restore --nats does, or tidal::nats::recover_shard), then run\n"
                "finish-recovery.\n",
                path.c_str(), backup.c_str(), static_cast<unsigned long long>(linked),
                static_cast<unsigned long long>(copied));
  }
  return kExitOk;
}

int cmd_rotate_key(tidal::Db& db, const std::string& file, bool json) {
  tidal::Result<std::string> key = read_key_file(file);
  if (!key.ok()) return db_failure("rotate-key", key.status());
  const tidal::Status s = db.rotate_key_encryption_key(*key);
  std::fill(key->begin(), key->end(), '\0');
  if (!s.ok()) return db_failure("rotate-key", s);
  if (json) std::printf("{\"action\":\"rotate-key\",\"done\":true}\n");
  else std::printf("rotate-key: every bucket key is wrapped with the key in %s; open the Db with --key-file %s\n",
                   file.c_str(), file.c_str());
  return kExitOk;
}

int cmd_finish_recovery(tidal::Db& db, bool json) {
  const bool was = db.stats().recovering;
  if (tidal::Status s = db.finish_recovery(); !s.ok()) return db_failure("finish-recovery", s);
  const tidal::Stats st = db.stats();
  if (json) {
    std::printf("{\"action\":\"finish-recovery\",\"was_recovering\":%s,\"incarnation\":%s}\n", was ? "true" : "false",
                json_string(st.change_feed_incarnation).c_str());
  } else if (was) {
    std::printf("finish-recovery: done; the Db serves again%s%s\n",
                st.change_feed ? ", its change feed re-seeded as incarnation " : "",
                st.change_feed ? st.change_feed_incarnation.c_str() : "");
  } else {
    std::printf("finish-recovery: the Db was not recovering; nothing done\n");
  }
  return kExitOk;
}

int cmd_reseed(tidal::Db& db, bool json) {
  tidal::Result<std::uint64_t> first = db.reseed_change_feed();
  if (!first.ok()) return db_failure("reseed", first.status());
  const tidal::Stats st = db.stats();
  const auto shard = static_cast<unsigned long long>(st.change_feed_shard_id);
  const auto from = static_cast<unsigned long long>(*first);
  const auto to = static_cast<unsigned long long>(st.change_feed_last_seq);
  const auto bytes = static_cast<unsigned long long>(st.change_feed_pending_bytes);
  if (json) {
    std::printf("{\"action\":\"reseed\",\"shard_id\":%llu,\"incarnation\":\"%s\",\"first_seq\":%llu,\"last_seq\":%llu,"
                "\"snapshot_bytes\":%llu}\n",
                shard, st.change_feed_incarnation.c_str(), from, to, bytes);
  } else {
    std::printf("reseed: shard %llu is incarnation %s from seq %llu; its snapshot is seqs %llu..%llu (%llu bytes).\n"
                "Every view replaces the shard's contribution once it applies seq %llu: 'tidalctl view PATH applied'\n"
                "shows the shard at incarnation %s, seq %llu or later.\n",
                shard, st.change_feed_incarnation.c_str(), from, from, to, bytes, from,
                st.change_feed_incarnation.c_str(), to);
  }
  return kExitOk;
}

// `text` (or its error) to stdout.
int print_metrics(const tidal::Result<std::string>& text) {
  if (!text.ok()) {
    std::fprintf(stderr, "tidalctl: %s\n", text.status().to_string().c_str());
    return kExitFailed;
  }
  std::fputs(text->c_str(), stdout);
  return kExitOk;
}

int cmd_stats(tidal::Db& db, bool json, bool prometheus, const std::string& path) {
  if (prometheus) return print_metrics(tidal::prometheus_text(db.stats(), {{"db", path}}));
  const tidal::Stats st = db.stats();
  const std::pair<const char*, std::uint64_t> rows[] = {
      {"signals", st.signals},
      {"personal_updates", st.personal_updates},
      {"cohort_attributions", st.cohort_attributions},
      {"community_forwards", st.community_forwards},
      {"gated_cohort", st.gated_cohort},
      {"gated_community", st.gated_community},
      {"leaves", st.leaves},
      {"rejoins", st.rejoins},
      {"users_left", st.users_left},
      {"corrupt_records_treated_as_left", st.corrupt_records_treated_as_left},
  };
  if (json) {
    std::string out = "{";
    for (const auto& [name, value] : rows) {
      // Appended piece by piece: GCC 12 at -O2 reports a false -Wrestrict for
      // `"\"" + std::string(name) + ...` (a temporary appended to itself).
      if (out.size() > 1) out += ',';
      out += '"';
      out += name;
      out += "\":";
      out += std::to_string(value);
    }
    std::printf("%s}\n", out.c_str());
    return kExitOk;
  }
  for (const auto& [name, value] : rows) std::printf("%-32s %llu\n", name, static_cast<unsigned long long>(value));
  std::printf("(from a fresh read-only open: users_left is rebuilt from storage; the other counters\n"
              " count since this open, so they are 0 here. Export live counters from the host's Db.)\n");
  return kExitOk;
}

// Runs `check` (verify or rematerialize, minutes at millions of users) while
// a thread draws its ledger check's progress from db.stats() on a terminal's
// stderr. When a purge's erasure makes the check start over, the bar says so
// and starts again.
template <typename Check>
auto with_check_progress(tidal::Db& db, const char* label, Check check) -> decltype(check()) {
  if (::isatty(STDERR_FILENO) != 1) return check();
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    std::optional<tidal::cli::ProgressBar> bar;
    std::uint64_t restarts = db.stats().ledger_check_restarts, shown = 0;
    for (; !done.load(); std::this_thread::sleep_for(std::chrono::milliseconds(100))) {
      const tidal::Stats st = db.stats();
      if (st.ledger_check_restarts != restarts) {
        restarts = st.ledger_check_restarts;
        if (bar) bar->finish(shown);
        bar.reset();
        std::fprintf(stderr, "%s: started over (a purge needed the check's snapshot)\n", label);
      }
      if (!bar && st.ledger_check_records_estimate != 0) bar.emplace(label, st.ledger_check_records_estimate, false);
      if (!bar || st.ledger_check_records_read == 0) continue;
      shown = std::min(st.ledger_check_records_read, st.ledger_check_records_estimate);
      bar->update(shown);
    }
    if (bar) bar->finish(shown);
  });
  auto result = check();
  done.store(true);
  watcher.join();
  return result;
}

int cmd_verify(tidal::Db& db, bool json) {
  tidal::Result<tidal::VerifyReport> report = with_check_progress(db, "verify", [&] { return db.verify(); });
  if (!report.ok()) return db_failure("verify", report.status());
  if (json) {
    std::string problems;
    for (const std::string& p : report->problems) {
      if (!problems.empty()) problems += ',';
      problems += json_string(p);  // appended, not concatenated: see cmd_stats
    }
    std::printf("{\"ok\":%s,\"records_checked\":%llu,\"problems\":[%s]}\n", report->ok() ? "true" : "false",
                static_cast<unsigned long long>(report->records_checked), problems.c_str());
  } else {
    for (const std::string& p : report->problems) std::printf("problem: %s\n", p.c_str());
    std::printf("verify: %llu records checked, %zu problems\n",
                static_cast<unsigned long long>(report->records_checked), report->problems.size());
  }
  return report->ok() ? kExitOk : kExitFailed;
}

std::string receipt_json(const tidal::PurgeReceipt& r) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"user_id\":%llu,\"left_at_ns\":%llu,\"left_at\":%s,\"purged_at_ns\":%llu,\"purged_at\":%s,"
                "\"entries_removed\":%llu,\"cohort_weight_removed\":%.17g,\"community_weight_removed\":%.17g,"
                "\"erasure_complete\":%s}",
                static_cast<unsigned long long>(r.user_id), static_cast<unsigned long long>(r.left_at_ns),
                json_time(r.left_at_ns).c_str(), static_cast<unsigned long long>(r.purged_at_ns),
                json_time(r.purged_at_ns).c_str(), static_cast<unsigned long long>(r.entries_removed),
                r.cohort_weight_removed, r.community_weight_removed, r.erasure_complete ? "true" : "false");
  return buf;
}

std::string receipt_text(const tidal::PurgeReceipt& r) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "user %llu: purged at %s (%llu ns): %llu ledger entries removed, cohort weight %.17g, community "
                "weight %.17g; boundary left_at %s (%llu ns)%s",
                static_cast<unsigned long long>(r.user_id), text_time(r.purged_at_ns).c_str(),
                static_cast<unsigned long long>(r.purged_at_ns), static_cast<unsigned long long>(r.entries_removed),
                r.cohort_weight_removed, r.community_weight_removed, text_time(r.left_at_ns).c_str(),
                static_cast<unsigned long long>(r.left_at_ns),
                r.erasure_complete ? "" : "; physical erasure NOT complete (finished by the next purge or open)");
  return buf;
}

int cmd_receipts(tidal::Db& db, std::uint64_t user, bool json) {
  tidal::Result<std::vector<tidal::PurgeReceipt>> receipts = db.purge_receipts(user);
  if (!receipts.ok()) return db_failure("receipts", receipts.status());
  if (json) {
    std::string items;
    for (const auto& r : *receipts) {
      if (!items.empty()) items += ',';
      items += receipt_json(r);  // appended piece by piece: GCC 12 -Wrestrict misfires on "a" + std::string
    }
    std::printf("{\"user_id\":%llu,\"receipts\":[%s]}\n", static_cast<unsigned long long>(user), items.c_str());
  } else {
    for (const auto& r : *receipts) std::printf("%s\n", receipt_text(r).c_str());
    std::printf("user %llu: %zu purge receipts\n", static_cast<unsigned long long>(user), receipts->size());
  }
  return kExitOk;
}

int cmd_rematerialize(tidal::Db& db, bool repair, bool json) {
  tidal::Result<tidal::RematerializeReport> report =
      with_check_progress(db, "rematerialize", [&] { return db.rematerialize_shared_aggregates(repair); });
  if (!report.ok()) return db_failure("rematerialize", report.status());
  if (json) {
    std::string items;
    for (const std::string& m : report->mismatches) {
      if (!items.empty()) items += ',';
      items += json_string(m);
    }
    std::printf("{\"aggregates_checked\":%llu,\"ledger_entries_read\":%llu,\"mismatches\":[%s],\"repaired\":%s}\n",
                static_cast<unsigned long long>(report->aggregates_checked),
                static_cast<unsigned long long>(report->ledger_entries_read), items.c_str(),
                report->repaired ? "true" : "false");
  } else {
    for (const std::string& m : report->mismatches) std::printf("mismatch: %s\n", m.c_str());
    std::printf("rematerialize: %llu aggregates checked, %llu ledger entries read, %zu mismatches%s\n",
                static_cast<unsigned long long>(report->aggregates_checked),
                static_cast<unsigned long long>(report->ledger_entries_read), report->mismatches.size(),
                report->repaired ? ", all repaired" : "");
  }
  // Repaired mismatches are fixed: exit 0; found and left (or unrepairable): 1.
  return report->mismatches.empty() || report->repaired ? kExitOk : kExitFailed;
}

// ---- write commands ----

// The open did the work (Storage::open); this reports it.
int cmd_migrate(bool upgraded, bool json) {
  // A format-3 Db is upgraded by any writable open, this one included (the
  // key store and the sealed ledger created; nothing rewritten).
  const char* what = upgraded ? "upgraded from format 2 to format 4" : "in format 4; nothing else changed";
  if (json) std::printf("{\"format\":4,\"upgraded\":%s}\n", upgraded ? "true" : "false");
  else std::printf("migrate: %s\n", what);
  return kExitOk;
}

int cmd_purge(tidal::Db& db, std::uint64_t user, bool json) {
  tidal::Result<tidal::PurgeReceipt> r = db.purge_community_contributions(user);
  if (!r.ok()) return db_failure("purge", r.status());
  std::printf("%s\n", json ? receipt_json(*r).c_str() : receipt_text(*r).c_str());
  return kExitOk;
}

// Leaves or rejoins one user; `changed` tells whether the state changed.
tidal::Status apply(tidal::Db& db, bool leave, std::uint64_t user, bool* changed) {
  const std::uint64_t before = leave ? db.stats().leaves : db.stats().rejoins;
  tidal::Status s = leave ? db.leave_community_layer(user) : db.rejoin_community_layer(user);
  *changed = s.ok() && (leave ? db.stats().leaves : db.stats().rejoins) != before;
  return s;
}

int cmd_leave_or_rejoin(tidal::Db& db, bool leave, std::uint64_t user, bool json) {
  const char* action = leave ? "leave" : "rejoin";
  bool changed = false;
  if (tidal::Status s = apply(db, leave, user, &changed); !s.ok()) return db_failure(action, s);
  tidal::Result<tidal::CommunityMembership> m = db.community_layer_status(user);
  if (!m.ok()) return db_failure(action, m.status());
  const auto u = static_cast<unsigned long long>(user);
  if (json) {
    std::printf("{\"user_id\":%llu,\"action\":\"%s\",\"changed\":%s,\"status\":\"%s\",\"left_at_ns\":%s,\"left_at\":%s}\n",
                u, action, changed ? "true" : "false", status_name(m->status).c_str(), json_u64(m->left_at_ns).c_str(),
                json_time(m->left_at_ns).c_str());
  } else if (leave) {
    std::printf("user %llu: %s (left_at %s, %s ns)\n", u,
                changed ? "left the community layer" : "already Left; nothing changed",
                text_time(m->left_at_ns).c_str(), text_u64(m->left_at_ns).c_str());
  } else {
    std::printf("user %llu: %s (last leave %s, %s ns)\n", u,
                changed ? "rejoined the community layer" : "already Active; nothing changed",
                text_time(m->left_at_ns).c_str(), text_u64(m->left_at_ns).c_str());
  }
  return kExitOk;
}

struct BadLine {
  std::uint64_t number;
  std::string text;
  std::string error;  // empty: not a user id
};

// Users per bulk call: the Db writes each call in synced batches of 10,000,
// and the progress bar moves once per call.
constexpr std::size_t kBulkChunk = 10'000;

// `line` without leading and trailing blanks (spaces, tabs, CR, VT, FF).
std::string_view trimmed(std::string_view line) {
  const std::size_t first = line.find_first_not_of(" \t\r\v\f");
  if (first == std::string_view::npos) return {};
  return line.substr(first, line.find_last_not_of(" \t\r\v\f") - first + 1);
}

// Applies leave or rejoin to every user id in `lines` (one per line;
// surrounding blanks are ignored), through the bulk API in calls of
// kBulkChunk users. Bad lines are reported and skipped; a Db error stops the
// run (leave and rejoin are idempotent, so re-running the file is safe).
int cmd_bulk(tidal::Db& db, const std::string& action_name, const std::string& source,
             const std::vector<std::string>& lines, bool json) {
  const bool leave = action_name == "leave";
  const bool purge = action_name == "purge";
  const char* action = action_name.c_str();
  std::vector<BadLine> bad;
  std::vector<std::uint64_t> users;
  std::vector<std::size_t> line_of;  // 1-based line number of each entry of `users`
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string_view text = trimmed(lines[i]);
    if (text.empty() || text.front() == '#') continue;  // blank or comment
    std::optional<std::uint64_t> user = tidal::cli::parse_u64(text);
    if (!user) {
      bad.push_back({i + 1, lines[i], {}});
      continue;
    }
    if (purge) {
      // The Db refuses a whole call when one user is not Left: report such
      // users as bad lines instead, and purge the rest.
      tidal::Result<tidal::CommunityMembership> m = db.community_layer_status(*user);
      if (m.ok() && m->status != tidal::MembershipStatus::Left) {
        bad.push_back({i + 1, lines[i], "user is Active (only a Left user can be purged)"});
        continue;
      }
    }
    users.push_back(*user);
    line_of.push_back(i + 1);
  }

  std::uint64_t processed = 0, changed_count = 0;
  // The time in the Db's calls alone (JSON's "seconds"): not the file's
  // reading, nor the checks of its lines.
  std::chrono::steady_clock::duration in_calls{};
  const auto timed = [&in_calls](auto&& call) {
    const auto start = std::chrono::steady_clock::now();
    auto result = call();
    in_calls += std::chrono::steady_clock::now() - start;
    return result;
  };
  std::optional<std::string> failure;
  tidal::cli::ProgressBar progress(action, users.size(), /*lines_when_not_tty=*/false);
  // A purge call's erasure rewrites every file of bucket keys (and, for
  // records carried from format 3, every ledger file) that holds a key of
  // one of its users' groups, and users spread over the Db are in every
  // file: chunks as large as the
  // other commands' (in format 3 at 1M users, chunks of 1,000 made a purge
  // of 5,000 users rewrite the whole ledger five times, ~70 s instead of ~16).
  const std::size_t chunk_size = kBulkChunk;
  for (std::size_t begin = 0; begin < users.size(); begin += chunk_size) {
    progress.update(begin);
    const std::size_t n = std::min(chunk_size, users.size() - begin);
    const std::span<const std::uint64_t> chunk(users.data() + begin, n);
    std::uint64_t changed = 0;
    tidal::Status s;
    if (purge) {
      // One call per chunk: one flush, one forced compaction for all its users.
      tidal::Result<std::vector<tidal::PurgeReceipt>> r = timed([&] { return db.purge_community_contributions(chunk); });
      if (r.ok()) {
        for (const auto& receipt : *r) changed += receipt.entries_removed != 0 ? 1 : 0;
      } else {
        s = r.status();
      }
    } else {
      const std::uint64_t before = leave ? db.stats().leaves : db.stats().rejoins;
      s = timed([&] { return leave ? db.leave_community_layer(chunk) : db.rejoin_community_layer(chunk); });
      changed = (leave ? db.stats().leaves : db.stats().rejoins) - before;
    }
    changed_count += changed;
    if (!s.ok()) {
      processed += changed;  // the users of the chunk known to be applied
      failure = source + ":" + std::to_string(line_of[begin]) + "-" + std::to_string(line_of[begin + n - 1]) + ": " +
                action + " of " + std::to_string(n) + " users failed: " + s.to_string() +
                "; stopped here, the users on earlier lines were applied (" + action +
                " is idempotent: re-run the file once fixed" + (purge ? "; purge_receipts lists what was done" : "") +
                ")";
      break;
    }
    processed += n;
  }
  progress.finish(users.size());

  for (const BadLine& b : bad) {
    std::fprintf(stderr, "tidalctl: %s:%llu: %s\n", source.c_str(), static_cast<unsigned long long>(b.number),
                 b.error.empty() ? invalid_user_text(b.text).c_str() : (b.text + ": " + b.error).c_str());
  }
  if (failure) std::fprintf(stderr, "tidalctl: %s\n", failure->c_str());
  const auto unchanged = processed - changed_count;
  if (json) {
    std::string items;
    for (const BadLine& b : bad) {
      items += (items.empty() ? "{" : ",{") + std::string("\"line\":") + std::to_string(b.number) +
               ",\"text\":" + json_string(b.text) +
               ",\"error\":" + json_string(b.error.empty() ? "invalid user id" : b.error) + "}";
    }
    std::printf("{\"action\":\"%s\",\"source\":%s,\"processed\":%llu,\"changed\":%llu,\"unchanged\":%llu,"
                "\"bad_lines\":[%s],\"error\":%s,\"seconds\":%.6f}\n",
                action, json_string(source).c_str(), static_cast<unsigned long long>(processed),
                static_cast<unsigned long long>(changed_count), static_cast<unsigned long long>(unchanged),
                items.c_str(), failure ? json_string(*failure).c_str() : "null",
                std::chrono::duration<double>(in_calls).count());
  } else {
    std::printf("%s: %llu users processed from %s: %llu %s, %llu %s; %zu bad lines%s\n", action,
                static_cast<unsigned long long>(processed), source.c_str(),
                static_cast<unsigned long long>(changed_count), purge ? "purged" : leave ? "left" : "rejoined",
                static_cast<unsigned long long>(unchanged),
                purge ? "had nothing to remove" : leave ? "already Left" : "already Active", bad.size(),
                failure ? "; STOPPED on a Db error" : "");
  }
  return bad.empty() && !failure ? kExitOk : kExitFailed;
}

int held_failure(const std::string& command, const std::string& path, const std::string& detail) {
  std::fprintf(stderr,
               "tidalctl: cannot %s: the Db at '%s' is held open read-write by another process (a host "
               "service?); write commands need it to themselves: stop that process, or make the change "
               "through its API. Read-only commands still work.\n  (%s)\n",
               command.c_str(), path.c_str(), detail.c_str());
  return kExitFailed;
}

// Reads every line of `path` ('-' = stdin) into `lines`.
bool read_lines(const std::string& path, std::vector<std::string>* lines) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (path != "-") {
    file.open(path);
    if (!file) return false;
    in = &file;
  }
  std::string line;
  while (std::getline(*in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF files
    lines->push_back(line);
  }
  return !in->bad();
}

// ---- global view ----

// `score` in the shortest form that reads back as the same double ("0.3").
std::string shortest(double score) {
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, score);
  return std::string(buf, r.ptr);
}

int view_applied(const tidal::GlobalView& view, bool json) {
  tidal::Result<std::vector<tidal::ShardProgress>> shards = view.applied_shards();
  if (!shards.ok()) return db_failure("view applied", shards.status());
  if (json) {
    std::string items;
    for (const tidal::ShardProgress& p : *shards) {
      if (!items.empty()) items += ',';
      items += "{\"shard_id\":" + std::to_string(p.shard_id) + ",\"applied_seq\":" + std::to_string(p.applied_seq) +
               ",\"incarnation\":\"" + p.incarnation + "\"}";
    }
    std::printf("{\"shards\":[%s]}\n", items.c_str());
    return kExitOk;
  }
  std::printf("%-20s  %-20s  %s\n", "shard_id", "applied_seq", "incarnation");
  for (const tidal::ShardProgress& p : *shards) {
    std::printf("%-20llu  %-20llu  %s\n", static_cast<unsigned long long>(p.shard_id),
                static_cast<unsigned long long>(p.applied_seq), p.incarnation.empty() ? "-" : p.incarnation.c_str());
  }
  std::printf("(%zu shards)\n", shards->size());
  return kExitOk;
}

int view_score(const tidal::GlobalView& view, const std::string& kind, std::uint64_t id, std::uint64_t item,
               bool json) {
  tidal::Result<double> score = kind == "cohort" ? view.cohort_score(id, item) : view.community_score(id, item);
  if (!score.ok()) return db_failure("view " + kind, score.status());
  const auto i = static_cast<unsigned long long>(id);
  const auto it = static_cast<unsigned long long>(item);
  if (json) {
    std::printf("{\"%s_id\":%llu,\"item_id\":%llu,\"score\":%s}\n", kind.c_str(), i, it, shortest(*score).c_str());
  } else {
    std::printf("%-12s %llu\n%-12s %llu\n%-12s %s\n", (kind + "_id").c_str(), i, "item_id", it, "score",
                shortest(*score).c_str());
  }
  return kExitOk;
}

// tidalctl [--json] view PATH applied | cohort ID ITEM | community ID ITEM.
// The view is opened read-only: it works while a host service holds it, and
// never creates or changes anything.
int cmd_view(const Args& args) {
  if (args.db) return usage_error("view takes the view's directory as its first operand (view PATH ...), not --db");
  if (args.from) return usage_error("--from applies to leave, rejoin and purge only, not view");
  if (args.repair) return usage_error("--repair applies to rematerialize only, not view");
  if (args.strict_erasure) return usage_error("--strict-erasure applies to purge only, not view");
  if (args.prometheus && args.json) return usage_error("--prometheus and --json are two output formats: give one");
  const std::vector<std::string> operands(args.positional.begin() + 1, args.positional.end());
  const std::string forms = "view PATH applied, view PATH cohort ID ITEM or view PATH community ID ITEM";
  if (operands.size() < 2) return usage_error("view needs a PATH and what to show: " + forms);
  const std::string& path = operands[0];
  const std::string& what = operands[1];
  std::uint64_t id = 0, item = 0;
  if (what == "applied") {
    if (operands.size() != 2) return usage_error("view PATH applied takes no more arguments (got '" + operands[2] + "')");
  } else if (what == "cohort" || what == "community") {
    if (operands.size() != 4) {
      return usage_error("view PATH " + what + " takes exactly ID and ITEM (got " + std::to_string(operands.size() - 2) +
                         ")");
    }
    const std::optional<std::uint64_t> parsed_id = tidal::cli::parse_u64(operands[2]);
    const std::optional<std::uint64_t> parsed_item = tidal::cli::parse_u64(operands[3]);
    if (!parsed_id || !parsed_item) {
      const bool bad_id = !parsed_id;
      return usage_error("invalid " + (bad_id ? what + " id" : std::string("item id")) + " '" +
                         operands[bad_id ? 2 : 3] +
                         "': expected an unsigned 64-bit decimal integer (digits only, 0..18446744073709551615)");
    }
    id = *parsed_id;
    item = *parsed_item;
  } else {
    return usage_error("unknown view command '" + what + "': " + forms);
  }
  if (args.prometheus && what != "applied") {
    return usage_error("--prometheus applies to stats and view PATH applied only, not view PATH " + what);
  }

  tidal::GlobalViewOptions options;
  options.read_only = true;
  tidal::Result<std::unique_ptr<tidal::GlobalView>> opened = tidal::GlobalView::open(path, options);
  if (!opened.ok()) {
    const tidal::Status& s = opened.status();
    std::fprintf(stderr, "tidalctl: cannot open the global view at '%s': %s\n", path.c_str(), s.to_string().c_str());
    // Missing, a file, a Db or another database: a path that is not a view.
    const bool bad_path = s.code() == tidal::StatusCode::NotFound || s.code() == tidal::StatusCode::InvalidArgument;
    return bad_path ? kExitUsage : kExitFailed;
  }
  tidal::GlobalView& view = **opened;
  int rc = kExitOk;
  if (args.prometheus) {
    tidal::Result<std::vector<tidal::ShardProgress>> shards = view.applied_shards();
    rc = shards.ok() ? print_metrics(tidal::prometheus_text(*shards, {{"view", path}}))
                     : print_metrics(shards.status());
  } else {
    rc = what == "applied" ? view_applied(view, args.json) : view_score(view, what, id, item, args.json);
  }
  if (tidal::Status s = view.close(); !s.ok()) {
    std::fprintf(stderr, "tidalctl: close of the global view at '%s' failed: %s\n", path.c_str(), s.to_string().c_str());
    return kExitFailed;
  }
  return rc;
}

int run(int argc, char** argv) {
  Args args;
  if (std::optional<std::string> error = parse_args(argc, argv, &args)) return usage_error(*error);
  if (args.help) {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  if (args.positional.empty()) return usage_error("no command given");

  const std::string& name = args.positional[0];
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (c.name == name) command = &c;
  }
  if (command == nullptr) return usage_error("unknown command '" + name + "'");
  if (name == "view") return cmd_view(args);
  if (!args.db) return usage_error("missing --db PATH (the Db directory " + name + " should use)");
  if (args.prometheus && name != "stats") {
    return usage_error("--prometheus applies to stats and view PATH applied only, not " + name);
  }
  if (args.prometheus && args.json) return usage_error("--prometheus and --json are two output formats: give one");

  // Operands, all checked before anything is opened.
  const std::vector<std::string> operands(args.positional.begin() + 1, args.positional.end());
  std::optional<std::uint64_t> user;
  std::vector<std::string> lines;
  if (args.from && !command->writes) return usage_error("--from applies to leave, rejoin and purge only, not " + name);
  if (args.repair && name != "rematerialize") return usage_error("--repair applies to rematerialize only, not " + name);
  if (args.strict_erasure && name != "purge") return usage_error("--strict-erasure applies to purge only, not " + name);
  if (args.from) {
    if (!operands.empty()) return usage_error(name + " takes either USER or --from FILE, not both");
    if (!read_lines(*args.from, &lines)) {
      return usage_error("cannot read user ids from '" + *args.from + "': no such file or not readable");
    }
  } else if (command->takes_user) {
    if (operands.size() != 1) return usage_error(name + " takes exactly one USER (got " + std::to_string(operands.size()) + ")");
    user = tidal::cli::parse_u64(operands[0]);
    if (!user) return usage_error(invalid_user_text(operands[0]));
  } else if (name == "backup" || name == "restore" || name == "rotate-key") {
    if (operands.size() != 1) {
      return usage_error(name + " takes exactly one " +
                         (name == "backup" ? "DIR" : name == "restore" ? "BACKUP" : "FILE") + " (got " +
                         std::to_string(operands.size()) + ")");
    }
  } else if (!operands.empty()) {
    return usage_error(name + " takes no arguments (got '" + operands[0] + "')");
  }
  if (args.keep && name != "backup") return usage_error("--keep applies to backup only, not " + name);
  if ((args.nats || args.journal_stream || args.journal_subject_prefix) && name != "restore") {
    return usage_error("--nats, --journal-stream and --journal-subject-prefix apply to restore only, not " + name);
  }
  if ((args.journal_stream || args.journal_subject_prefix) && !args.nats) {
    return usage_error("--journal-stream and --journal-subject-prefix need --nats SERVERS");
  }
  if (name == "restore") return cmd_restore(operands[0], *args.db, args);

  // The library refuses, before touching anything, a path that does not
  // exist, holds no database, or is held read-write by another process.
  const std::string& path = *args.db;
  tidal::Options options;
  options.create_if_missing = false;
  options.read_only = !command->writes && !args.repair;
  options.strict_erasure = args.strict_erasure;
  if (args.key_file) options.key_encryption_key = [file = *args.key_file] { return read_key_file(file); };
  // verify must run to list what is wrong, so it gates a corrupt leave record
  // instead of failing the open (read-only: nothing is written).
  if (name == "verify") options.corrupt_record_policy = tidal::CorruptRecordPolicy::TreatAsLeft;
  bool upgraded = false;
  if (name == "migrate") {
    // Past format 2 already when a read-only open (which never upgrades) works.
    tidal::Options ro = options;
    ro.read_only = true;
    tidal::Result<std::unique_ptr<tidal::Db>> probe = tidal::Db::open(path, ro);
    upgraded = !probe.ok() && probe.status().message().find("in format 2") != std::string::npos;
  }
  tidal::Result<std::unique_ptr<tidal::Db>> opened = open_db(path, options);
  if (!opened.ok()) {
    const tidal::Status& s = opened.status();
    if (s.code() == tidal::StatusCode::Busy) return held_failure(name, path, s.to_string());
    std::fprintf(stderr, "tidalctl: cannot open the Db at '%s' for %s: %s\n", path.c_str(), name.c_str(),
                 s.to_string().c_str());
    const bool bad_path = s.code() == tidal::StatusCode::NotFound || s.code() == tidal::StatusCode::InvalidArgument;
    return bad_path ? kExitUsage : kExitFailed;
  }
  tidal::Db& db = **opened;

  int rc = kExitOk;
  if (name == "status") rc = cmd_status(db, *user, args.json);
  else if (name == "history") rc = cmd_history(db, *user, args.json);
  else if (name == "list-left") rc = cmd_list_left(db, args.json);
  else if (name == "stats") rc = cmd_stats(db, args.json, args.prometheus, path);
  else if (name == "changes") rc = cmd_changes(db, args.json);
  else if (name == "verify") rc = cmd_verify(db, args.json);
  else if (name == "receipts") rc = cmd_receipts(db, *user, args.json);
  else if (name == "rematerialize") rc = cmd_rematerialize(db, args.repair, args.json);
  else if (name == "migrate") rc = cmd_migrate(upgraded, args.json);
  else if (name == "reseed") rc = cmd_reseed(db, args.json);
  else if (name == "backup") rc = cmd_backup(db, operands[0], args.keep, args.json);
  else if (name == "finish-recovery") rc = cmd_finish_recovery(db, args.json);
  else if (name == "rotate-key") rc = cmd_rotate_key(db, operands[0], args.json);
  else if (args.from) rc = cmd_bulk(db, name, *args.from == "-" ? "<stdin>" : *args.from, lines, args.json);
  else if (name == "purge") rc = cmd_purge(db, *user, args.json);
  else rc = cmd_leave_or_rejoin(db, name == "leave", *user, args.json);

  if (tidal::Status s = db.close(); !s.ok()) {
    std::fprintf(stderr, "tidalctl: close of '%s' failed: %s\n", path.c_str(), s.to_string().c_str());
    return kExitFailed;
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const int rc = run(argc, argv);
  std::fflush(stdout);
  return rc;
}
