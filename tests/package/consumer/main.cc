// Opens a Db, leaves a user, reopens and checks the leave survived.
#include <cstdio>
#include <string>

#include <tidal/db.h>

static_assert(TIDAL_VERSION_MAJOR >= 0 && TIDAL_VERSION_MINOR >= 0, "db.h brings tidal/version.h");

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string path = argv[1];
  {
    auto db = tidal::Db::open(path);
    if (!db.ok()) return std::printf("open: %s\n", db.status().to_string().c_str()), 1;
    if (!(*db)->join_community(1, 2).ok() || !(*db)->leave_community_layer(1).ok()) return 1;
    if (!(*db)->close().ok()) return 1;
  }
  auto db = tidal::Db::open(path);
  if (!db.ok()) return 1;
  auto status = (*db)->community_layer_status(1);
  if (!status.ok() || status->status != tidal::MembershipStatus::Left) return 1;
  auto out = (*db)->signal_with_context({1, 3, 1.0}, {{4}});
  if (!out.ok() || !out->gated) return 1;
  std::printf("consumer: ok (user 1 Left at %llu ns, signal gated)\n",
              static_cast<unsigned long long>(*status->left_at_ns));
  return 0;
}
