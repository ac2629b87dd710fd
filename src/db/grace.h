// Read-side critical sections with a grace period, for the leave gate (G2).
//
// Every signal runs inside a ReadSection. A ReadSection costs the calling
// thread two stores to its own cache line (its slot) and no lock: another
// thread only ever reads that slot. synchronize() returns once every
// ReadSection that was in progress when it was called has ended, so after
//     close the gate; synchronize();
// no signal that could have seen the gate open is still running.
//
// Ordering between a reader's slot store and its gate load, and the writer's
// gate store and its slot loads, comes from sys_membarrier
// (MEMBARRIER_CMD_PRIVATE_EXPEDITED), which runs a full barrier on every
// running thread of the process; the readers then need only a compiler
// barrier. Where membarrier is unavailable, readers use a seq_cst fence.
//
// The slots are process-wide: one per thread, reused after the thread exits,
// never freed. ReadSections nest.
#ifndef TIDAL_DB_GRACE_H_
#define TIDAL_DB_GRACE_H_

namespace tidal::grace {

class ReadSection {
 public:
  ReadSection();
  ~ReadSection();
  ReadSection(const ReadSection&) = delete;
  ReadSection& operator=(const ReadSection&) = delete;
};

// Registers the process for expedited membarrier (once; cheap afterwards).
// Returns whether readers may rely on it.
bool init();

// True when the calling thread is inside a ReadSection (e.g. in a
// ContributionSink callback): synchronize() would then wait for itself.
bool in_read_section();

// Waits until every ReadSection of another thread that was in progress when
// the call began has ended.
void synchronize();

}  // namespace tidal::grace

#endif  // TIDAL_DB_GRACE_H_
