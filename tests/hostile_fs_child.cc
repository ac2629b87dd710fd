// The Db process of the hostile file system tests (tests/hostile_fs_test.cc):
// a full or failing disk must fail calls, never abort the process, so the
// parent runs the Db here and sees an abort as a test failure instead of
// dying of it. Reads one command per line on stdin and answers each with one
// line on stdout (one write(2)):
//   open <path>          "ok" | "err <status>"  (default Options plus a sink)
//   open-ro <path>       the same, read-only
//   leave <user>         "ok" | "err <status>"
//   fill <from> <to>     leaves users from, from+1, ... up to `to` and stops
//                        at the first error: "filled <acknowledged> <status>"
//   gated <user>         one signal of the user with the sink: "gated" when
//                        the gate held it back and no contribution reached the
//                        sink, "open" when it went through, "err ..." else
//   left <from> <to>     "left <n>": how many of the users are Left
//   verify               "ok" | "err <problem or status>"
//   flush | close        "ok" | "err <status>"
//   contribute <from> <to>  each user joins community 9, signals item 7
//                        (weight 1, cohort 42) and leaves: "ok" | "err ..."
//   purge <user>         "purged <entries removed>" | "err <status>"
//   receipts <user>      "receipts <n> <entries removed by the first, or 0>"
//   score                cohort 42's and community 9's scores of item 7:
//                        "score <cohort> <community>"
//   files                every later purge's batch ingested as files, none
//                        through the WAL (Db::Impl::purge_wal_entries): "ok"
//   open-journal <path>  open with the privacy journal and the change feed
//                        (shard 1): "ok" | "err <status>"
//   backup <dir>         "ok" | "err <status>"
//   journal              keeps the journal's entries (all of them) for
//                        `replay`: "journal <n>"
//   replay               replay_journal of the kept entries: "ok" | "err ..."
//   finish-recovery      "ok" | "err <status>"
//   engine-flush         flushes both engines' memtables (Storage::flush,
//                        what close() and a purge's erasure do): "ok" | "err ..."
//   recoveries           "recoveries <n>": how many times an engine resumed
//                        writing in place after an error (Storage::recover)
// At end of input it closes the Db and exits 0.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "db/impl.h"
#include "tidal/db.h"

namespace {

void say(const std::string& line) {
  const std::string out = line + "\n";
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::write(STDOUT_FILENO, out.data() + done, out.size() - done);
    if (n <= 0) std::_Exit(4);
    done += static_cast<std::size_t>(n);
  }
}

std::string result(const tidal::Status& s) { return s.ok() ? "ok" : "err " + s.to_string(); }

class CountingSink : public tidal::ContributionSink {
 public:
  void on_contribution(const tidal::Contribution&) override { count.fetch_add(1); }
  std::atomic<std::uint64_t> count{0};
};

}  // namespace

int main() {
  auto sink = std::make_shared<CountingSink>();
  std::unique_ptr<tidal::Db> db;
  std::vector<tidal::JournalEntry> journal;
  std::string path;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    std::uint64_t a = 0;
    std::uint64_t b = 0;
    in >> cmd;
    if (cmd == "open" || cmd == "open-ro" || cmd == "open-journal") {
      in >> path;
      tidal::Options options;
      options.contribution_sink = sink;
      options.read_only = cmd == "open-ro";
      if (cmd == "open-journal") {
        options.journal = true;
        options.change_feed = true;
        options.shard_id = 1;
      }
      auto opened = tidal::Db::open(path, options);
      if (opened.ok()) db = std::move(*opened);
      say(result(opened.status()));
    } else if (db == nullptr) {
      say("err no open Db");
    } else if (cmd == "leave") {
      in >> a;
      say(result(db->leave_community_layer(a)));
    } else if (cmd == "fill") {
      in >> a >> b;
      std::uint64_t acknowledged = 0;
      tidal::Status s;
      for (std::uint64_t user = a; user <= b && s.ok(); ++user) {
        s = db->leave_community_layer(user);
        if (s.ok()) ++acknowledged;
      }
      say("filled " + std::to_string(acknowledged) + " " + result(s));
    } else if (cmd == "gated") {
      in >> a;
      const std::uint64_t before = sink->count.load();
      auto out = db->signal_with_context({a, 7, 1.0}, tidal::SignalContext{{42}});
      const std::uint64_t delta = sink->count.load() - before;
      if (!out.ok()) {
        say(result(out.status()));
      } else if (out->gated) {
        say(delta == 0 ? "gated" : "err gated yet " + std::to_string(delta) + " contributions reached the sink");
      } else {
        say(delta > 0 ? "open" : "err not gated yet no contribution reached the sink");
      }
    } else if (cmd == "left") {
      in >> a >> b;
      std::uint64_t n = 0;
      for (std::uint64_t user = a; user <= b; ++user) {
        auto st = db->community_layer_status(user);
        if (st.ok() && st->status == tidal::MembershipStatus::Left) ++n;
      }
      say("left " + std::to_string(n));
    } else if (cmd == "verify") {
      auto report = db->verify();
      if (!report.ok()) {
        say(result(report.status()));
      } else {
        say(report->ok() ? "ok" : "err " + report->problems.front());
      }
    } else if (cmd == "contribute") {
      in >> a >> b;
      tidal::Status s;
      for (std::uint64_t user = a; user <= b && s.ok(); ++user) {
        s = db->join_community(user, 9);
        if (s.ok()) s = db->signal_with_context({user, 7, 1.0}, tidal::SignalContext{{42}}).status();
        if (s.ok()) s = db->leave_community_layer(user);
      }
      say(result(s));
    } else if (cmd == "purge") {
      in >> a;
      auto receipt = db->purge_community_contributions(a);
      say(receipt.ok() ? "purged " + std::to_string(receipt->entries_removed) : result(receipt.status()));
    } else if (cmd == "receipts") {
      in >> a;
      auto receipts = db->purge_receipts(a);
      if (!receipts.ok()) {
        say(result(receipts.status()));
      } else {
        say("receipts " + std::to_string(receipts->size()) + " " +
            std::to_string(receipts->empty() ? 0 : receipts->front().entries_removed));
      }
    } else if (cmd == "score") {
      auto cohort = db->cohort_score(42, 7);
      auto community = db->community_score(9, 7);
      if (!cohort.ok() || !community.ok()) {
        say(result(cohort.ok() ? community.status() : cohort.status()));
      } else {
        std::ostringstream out;
        out << "score " << *cohort << " " << *community;
        say(out.str());
      }
    } else if (cmd == "files") {
      tidal::Db::Impl::purge_wal_entries = 0;
      say("ok");
    } else if (cmd == "backup") {
      std::string dir;
      in >> dir;
      say(result(db->backup(dir)));
    } else if (cmd == "journal") {
      auto entries = db->read_journal(0, std::size_t{1} << 30);
      if (entries.ok()) journal = std::move(*entries);
      say(entries.ok() ? "journal " + std::to_string(journal.size()) : result(entries.status()));
    } else if (cmd == "replay") {
      say(result(db->replay_journal(journal)));
    } else if (cmd == "finish-recovery") {
      say(result(db->finish_recovery()));
    } else if (cmd == "engine-flush") {
      say(result(tidal::Db::Impl::storage_for_testing(*db).flush()));
    } else if (cmd == "recoveries") {
      say("recoveries " + std::to_string(tidal::Db::Impl::storage_for_testing(*db).recoveries()));
    } else if (cmd == "flush") {
      say(result(db->flush()));
    } else if (cmd == "close") {
      say(result(db->close()));
      db.reset();
    } else {
      say("err unknown command: " + line);
    }
  }
  if (db != nullptr) (void)db->close();
  return 0;
}
