// A host that keeps its Db open until the process exits (issue 9 item 7).
//
//   tidal_exit_child global|static|exit PATH
//
// Opens the Db at PATH into a namespace-scope std::unique_ptr ("global" and
// "exit") or a function-local static ("static"); joins, signals and leaves
// user 42; then returns from main ("exit": calls std::exit from another
// thread) without closing. The test expects exit status 0, then reopens
// PATH and checks that user 42 is Left and the signals were kept.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "tidal/db.h"

namespace {

std::unique_ptr<tidal::Db> g_db;

int fail(const char* what, const tidal::Status& s) {
  std::fprintf(stderr, "exit_child: %s: %s\n", what, s.to_string().c_str());
  return 2;
}

int use(tidal::Db& db) {
  if (tidal::Status s = db.join_community(42, 7); !s.ok()) return fail("join", s);
  for (std::uint64_t i = 0; i < 100; ++i) {
    if (!db.signal_with_context({42, i, 1.0}, {{1}}).ok()) return fail("signal", tidal::Status::IOError("signal"));
  }
  if (tidal::Status s = db.leave_community_layer(42); !s.ok()) return fail("leave", s);
  return 0;
}

tidal::Db& static_db(const char* path) {
  static std::unique_ptr<tidal::Db> db = [&] {
    auto r = tidal::Db::open(path);
    if (!r.ok()) {
      std::fprintf(stderr, "exit_child: open: %s\n", r.status().to_string().c_str());
      std::exit(3);
    }
    return std::move(*r);
  }();
  return *db;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 64;
  const char* mode = argv[1];
  const char* path = argv[2];
  if (std::strcmp(mode, "static") == 0) return use(static_db(path));

  auto r = tidal::Db::open(path);
  if (!r.ok()) return fail("open", r.status());
  g_db = std::move(*r);
  if (int rc = use(*g_db); rc != 0) return rc;
  if (std::strcmp(mode, "exit") == 0) std::thread([] { std::exit(0); }).join();
  return 0;
}
