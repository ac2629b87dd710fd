// testing::refusal, for the NATS tests that expect a Publisher's or a
// JournalPublisher's start() to refuse (gtest's; nats_test_util.h is shared
// with tidal_nats_child, which has no gtest).
#ifndef TIDAL_TESTS_NATS_START_REFUSAL_H_
#define TIDAL_TESTS_NATS_START_REFUSAL_H_

#include <chrono>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "nats_cluster.h"
#include "tidal/status.h"

namespace tidal::nats::testing {

// The refusal a test expects of Publisher::start or JournalPublisher::start:
// start()'s own error when its first attempt reached the stream. A first
// attempt that met a cluster not ready yet (no JetStream leader, no
// responders) is no error (start returns OK, nats.h) and the thread tries
// again: the refusal is then what it halts on or keeps failing with once
// that is no longer the cluster's (an InvalidArgument or a Corruption),
// within `bound`: what stop() returns. A start() that returns OK though its
// first attempt refused the stream's config (InvalidArgument, found before
// the thread is ready) fails the test; a fence may come later, at the first
// publish (nats.h).
template <class P>
Status refusal(Result<std::unique_ptr<P>> p, std::chrono::milliseconds bound = std::chrono::seconds(20)) {
  if (!p.ok()) return p.status();
  const auto refused = [&] {
    const auto st = (*p)->stats();
    return st.halted || st.last_error.starts_with("InvalidArgument") || st.last_error.starts_with("Corruption");
  };
  // The thread's next attempt comes min_backoff after the first at the
  // earliest: a refusal of the config already there is the first attempt's.
  if (const std::string e = (*p)->stats().last_error; e.starts_with("InvalidArgument")) {
    ADD_FAILURE() << "start() returned OK, though its first attempt refused the config: " << e;
  }
  (void)eventually(refused, bound);
  return (*p)->stop();
}

}  // namespace tidal::nats::testing

#endif  // TIDAL_TESTS_NATS_START_REFUSAL_H_
