// The by_tag index: records of the indexed tags (community membership 0x01,
// community leave 0x11; is_indexed) are also kept in the by_tag column
// family, keyed tag-first (encode_index_key), in the same WriteBatch as the
// users record (Storage::put_record). Start-up reads only that index, so its
// cost grows with the number of such records, not with the users partition.
// A Db without a complete index (meta key kIndexVersionKey) is scanned in
// full once and backfilled; a read-only open scans in full without writing.
// This file and Storage::put_record/delete_record are the only code that
// reads or writes the index.
#ifndef TIDAL_STORAGE_INDEX_H_
#define TIDAL_STORAGE_INDEX_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "storage/format.h"
#include "storage/storage.h"
#include "tidal/status.h"

namespace tidal {

// True once the index holds a copy of every users record of an indexed tag.
Result<bool> index_complete(const Storage& storage);

// Backfills the index from a full scan of the users partition when the Db has
// none yet (no-op when complete or read-only).
Status ensure_index(Storage& storage);

// Calls fn(user_id, suffix, value) for every users record with `tag`, in user
// order, through the index when it is complete; stops at the first non-OK
// Status that fn returns, and returns it.
Status scan_tag(const Storage& storage, Tag tag,
                const std::function<Status(std::uint64_t, std::string_view, std::string_view)>& fn);

// For verify: receives one problem found, naming the column family and key.
using IndexProblemFn = std::function<void(std::string_view cf, std::string_view key, const std::string& what)>;

// The by_tag copy of the indexed users record `k` (decoded as `key`, value
// `v`) exists and holds the same value.
Status check_index_copy(const Storage& storage, const DecodedKey& key, std::string_view k, std::string_view v,
                        const IndexProblemFn& problem);

// Every index record is of an indexed tag and has its users original; adds
// the number of index records read to *records_checked.
Status verify_index(const Storage& storage, std::uint64_t* records_checked, const IndexProblemFn& problem);

}  // namespace tidal

#endif  // TIDAL_STORAGE_INDEX_H_
