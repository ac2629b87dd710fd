// A helper of the CLI tests: builds a global view for `tidalctl view`, using
// only the public API (<tidal/global_view.h>). The batch's payload is built
// byte by byte from docs/FORMAT.md ("The change feed"), as a consumer in any
// language would.
//
//   view_maker PATH
//       creates an empty view at PATH (if missing) and closes it
//   view_maker PATH SHARD SEQ cohort|community ID ITEM UNITS
//       applies one batch of one entry: UNITS (a signed count of 1e-9) added
//       to the cell; prints "applied" or "skipped" (already applied)
#include <tidal/global_view.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

namespace {

int fail(const char* what, const tidal::Status& s) {
  std::fprintf(stderr, "view_maker: %s failed: %s\n", what, s.to_string().c_str());
  return 1;
}

// [version 1][origin 1 = a writer's batch][count: 4 LE = 1]
// [kind: 1][owner: 8 BE][item: 8 BE][delta: 16 LE two's complement]
std::string one_entry_payload(std::uint8_t kind, std::uint64_t owner, std::uint64_t item, std::int64_t units) {
  std::string p = {1, 1, 1, 0, 0, 0, static_cast<char>(kind)};
  for (int i = 7; i >= 0; --i) p.push_back(static_cast<char>((owner >> (8 * i)) & 0xff));
  for (int i = 7; i >= 0; --i) p.push_back(static_cast<char>((item >> (8 * i)) & 0xff));
  const auto low = static_cast<std::uint64_t>(units);
  for (int i = 0; i < 8; ++i) p.push_back(static_cast<char>((low >> (8 * i)) & 0xff));
  p.append(8, units < 0 ? '\xff' : '\0');  // the sign, extended to 128 bits
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 8) {
    std::fprintf(stderr, "usage: view_maker PATH [SHARD SEQ cohort|community ID ITEM UNITS]\n");
    return 2;
  }
  tidal::Result<std::unique_ptr<tidal::GlobalView>> view = tidal::GlobalView::open(argv[1]);
  if (!view.ok()) return fail("open", view.status());
  if (argc == 8) {
    const std::string_view kind = argv[4];
    if (kind != "cohort" && kind != "community") {
      std::fprintf(stderr, "view_maker: kind must be cohort or community, not '%s'\n", argv[4]);
      return 2;
    }
    tidal::ChangeBatch batch;
    batch.shard_id = std::stoull(argv[2]);
    batch.seq = std::stoull(argv[3]);
    batch.payload = one_entry_payload(kind == "cohort" ? 2 : 3, std::stoull(argv[5]), std::stoull(argv[6]),
                                      std::stoll(argv[7]));
    tidal::Result<bool> applied = (*view)->apply(batch);
    if (!applied.ok()) return fail("apply", applied.status());
    std::printf("%s\n", *applied ? "applied" : "skipped");
  }
  if (tidal::Status s = (*view)->close(); !s.ok()) return fail("close", s);
  return 0;
}
