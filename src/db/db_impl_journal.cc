// Db::Impl: the privacy journal's calls (journal/journal.h). The writes that
// append to it are in db_impl_leave.cc (leaves, rejoins) and purge.cc
// (purge intents); this file holds the reads and the confirmation.
#include "db/guarded.h"
#include "db/impl.h"

namespace tidal {

Status Db::Impl::check_journal(const char* what) const {
  if (journal_) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": the Db at '" + storage_->path() +
                                 "' keeps no privacy journal (open it with Options::journal)");
}

Result<std::vector<JournalEntry>> Db::Impl::read_journal(std::uint64_t after_seq, std::size_t max_bytes) const {
  return guarded("read_journal", [&]() -> Result<std::vector<JournalEntry>> {
    Call call(this, "read_journal", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (Status s = check_journal("read_journal"); !s.ok()) return s;
    return journal_->read(after_seq, max_bytes);
  });
}

Result<std::uint64_t> Db::Impl::last_journal_seq() const {
  return guarded("last_journal_seq", [&]() -> Result<std::uint64_t> {
    Call call(this, "last_journal_seq", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (Status s = check_journal("last_journal_seq"); !s.ok()) return s;
    return journal_->last_seq();
  });
}

// A read: close() wakes it (Journal::shutdown) before it waits for the
// calls in flight. It waits, so a ContributionSink callback gets Busy.
Result<std::uint64_t> Db::Impl::wait_journal(std::uint64_t after_seq, std::chrono::milliseconds wait) const {
  return guarded("wait_journal", [&]() -> Result<std::uint64_t> {
    Call call(this, "wait_journal", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (Status s = check_outside_sink("wait_journal"); !s.ok()) return s;
    if (Status s = check_journal("wait_journal"); !s.ok()) return s;
    return journal_->wait_written(after_seq, wait);
  });
}

// A write: refused on a read-only Db and from inside a ContributionSink callback.
Status Db::Impl::confirm_journal(std::uint64_t through_seq) {
  return guarded("confirm_journal", [&]() -> Status {
    Call call(this, "confirm_journal", /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (Status s = check_journal("confirm_journal"); !s.ok()) return s;
    return journal_->confirm(through_seq);
  });
}

}  // namespace tidal
