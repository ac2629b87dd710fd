#!/usr/bin/env bash
# CLI tests of tidalctl, run by ctest (tidalctl_cli):
#   cli_test.sh TIDALCTL DB_HOLDER CORRUPT_RECORDS WORKDIR VIEW_MAKER FORMAT2_TARBALL
# Each check prints FAIL with the command, what was expected and what came
# out; the script exits 1 if any check failed.
set -u

CTL=$1
HOLDER=$2
CORRUPT=$3
WORK=$4
VIEW_MAKER=$5
FORMAT2=$6

rm -rf "$WORK"
mkdir -p "$WORK"
DB=$WORK/db
OUT=$WORK/stdout
ERR=$WORK/stderr
failures=0
checks=0
last=""
rc=0

# t ARGS...: runs tidalctl with ARGS (stdin from /dev/null unless redirected).
t() {
  last="tidalctl $*"
  "$CTL" "$@" >"$OUT" 2>"$ERR"
  rc=$?
}

fail() {
  failures=$((failures + 1))
  echo "FAIL: $1"
  echo "  command: $last"
  echo "  exit code: $rc"
  echo "  stdout: $(head -c 2000 "$OUT")"
  echo "  stderr: $(head -c 2000 "$ERR")"
}

rc_is() { checks=$((checks + 1)); [ "$rc" -eq "$1" ] || fail "expected exit code $1"; }
out_has() { checks=$((checks + 1)); grep -qE -- "$1" "$OUT" || fail "stdout should match /$1/"; }
err_has() { checks=$((checks + 1)); grep -qE -- "$1" "$ERR" || fail "stderr should match /$1/"; }
err_fixed() { checks=$((checks + 1)); grep -qF -- "$1" "$ERR" || fail "stderr should contain '$1'"; }
out_empty() { checks=$((checks + 1)); [ ! -s "$OUT" ] || fail "stdout should be empty"; }
# json EXPR: every line of stdout parses as JSON; EXPR (Python, over `d` =
# the first object and `lines` = all of them) is true.
json() {
  checks=$((checks + 1))
  python3 - "$OUT" "$1" <<'EOF' || fail "JSON check: $1"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
d = lines[0] if lines else None
if not eval(sys.argv[2]):
    sys.exit(1)
EOF
}
# A fingerprint of a directory's files (names, sizes, mtimes).
fingerprint() { find "$1" -type f -printf '%P %s %T@\n' 2>/dev/null | sort | md5sum; }

# ---- a Db with users 1..5 in communities; user 2 Left, user 3 left and rejoined ----
"$HOLDER" "$DB" --seed </dev/null >/dev/null || { echo "FAIL: could not seed $DB"; exit 1; }

# ---- help and usage errors (exit 2, nothing created) ----
t --help; rc_is 0; out_has '^Usage: tidalctl'; out_has 'list-left'
t -h; rc_is 0; out_has '^Usage: tidalctl'
t; rc_is 2; err_has 'no command given'
t --db "$DB" frobnicate; rc_is 2; err_has "unknown command 'frobnicate'"
t status 1; rc_is 2; err_has 'missing --db'
t --db; rc_is 2; err_has -- '--db needs a PATH'
t --db "$DB" --bogus status 1; rc_is 2; err_has "unknown option '--bogus'"
t --db "$DB" status; rc_is 2; err_has 'exactly one USER'
t --db "$DB" status 1 2; rc_is 2; err_has 'exactly one USER'
t --db "$DB" list-left 7; rc_is 2; err_has 'takes no arguments'
t --db "$DB" status --from /dev/null; rc_is 2; err_has 'leave, rejoin and purge only'
t --db "$DB" leave 1 --from /dev/null; rc_is 2; err_has 'either USER or --from'
before=$(fingerprint "$DB")
for bad in -1 +1 '' ' 1' '1 ' 1x 0x10 18446744073709551616 99999999999999999999 1.5; do
  t --db "$DB" status "$bad"; rc_is 2; err_fixed "invalid user id '$bad'"; out_empty
  t --db "$DB" leave "$bad"; rc_is 2; err_fixed "invalid user id '$bad'"
done
t --db "$DB" status 18446744073709551615; rc_is 0; out_has '^user_id +18446744073709551615$'
t --db "$DB" status 0; rc_is 0; out_has '^status +Active$'
checks=$((checks + 1)); [ "$before" = "$(fingerprint "$DB")" ] || { rc=0; fail "bad input changed files in $DB"; }

t --db "$WORK/missing" status 1; rc_is 2; err_has "cannot open tidal Db at '$WORK/missing': no such directory"
t --db "$WORK/missing" leave 1; rc_is 2; err_has "cannot open tidal Db at '$WORK/missing': no such directory"
checks=$((checks + 1)); [ ! -e "$WORK/missing" ] || fail "tidalctl created $WORK/missing"
mkdir "$WORK/empty"
for cmd in "status 1" "leave 1" "list-left" "verify"; do
  t --db "$WORK/empty" $cmd; rc_is 2; err_has "cannot open tidal Db at '$WORK/empty': the directory holds no database"
done
checks=$((checks + 1)); [ -z "$(ls -A "$WORK/empty")" ] || fail "tidalctl created files in $WORK/empty"
echo hello >"$WORK/afile"
t --db "$WORK/afile" status 1; rc_is 2; err_has "regular file"
t --db "$DB" leave --from "$WORK/no-such-list"; rc_is 2; err_has "cannot read user ids from '$WORK/no-such-list'"

# ---- read-only commands ----
t --db "$DB" status 2; rc_is 0; out_has '^status +Left$'; out_has '^left_at_ns +[0-9]{19}$'
out_has '^left_at +20[0-9]{2}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{9}Z$'; out_has '^communities +100, 200$'
t --db "$DB" --json status 2
json 'd["user_id"] == 2 and d["status"] == "Left" and d["left_at_ns"] > 0 and d["communities"] == [100, 200]'
json 'd["left_at"].endswith("Z") and len(d["left_at"]) == 30'
# the ISO form is the raw ns, to the nanosecond
json '__import__("datetime").datetime.fromisoformat(d["left_at"][:26]).replace(tzinfo=__import__("datetime").timezone.utc).timestamp() // 1 == d["left_at_ns"] // 10**9 and d["left_at"][20:29] == "%09d" % (d["left_at_ns"] % 10**9)'
t --db "$DB" --json status 1; rc_is 0; json 'd["status"] == "Active" and d["left_at_ns"] is None and d["left_at"] is None'
t --db "$DB" --json status 3; json 'd["status"] == "Active" and d["left_at_ns"] > 0'

t --db "$DB" history 3; rc_is 0; out_has '^1 +leave +[0-9]{19} +20'; out_has '^2 +rejoin +[0-9]{19} +20'
t --db "$DB" history 1; rc_is 0; out_has 'no leave or rejoin recorded'
t --db "$DB" --json history 3; rc_is 0
json '[e["event"] for e in d["events"]] == ["leave", "rejoin"] and d["events"][0]["at_ns"] < d["events"][1]["at_ns"]'

t --db "$DB" list-left; rc_is 0; out_has '^2 +[0-9]{19} +20.*Z$'; out_has '\(1 users Left\)'
t --db "$DB" --json list-left; rc_is 0; json 'len(lines) == 1 and d["user_id"] == 2 and d["left_at_ns"] > 0'

t --db "$DB" stats; rc_is 0; out_has '^users_left +1$'; out_has 'fresh read-only open'
t --db "$DB" --json stats; rc_is 0; json 'd["users_left"] == 1 and d["signals"] == 0 and len(d) == 10'
t --db "$DB" --prometheus stats; rc_is 0
out_has '^# TYPE tidal_db_users_left gauge$'; out_has "^tidal_db_users_left\\{db=\"$DB\"\\} 1$"
out_has '^# TYPE tidal_db_signals_total counter$'
t --db "$DB" --prometheus --json stats; rc_is 2; err_has 'two output formats'
t --db "$DB" --prometheus list-left; rc_is 2; err_has 'applies to stats and view PATH applied only'

t --db "$DB" verify; rc_is 0; out_has '^verify: [0-9]+ records checked, 0 problems$'
t --db "$DB" --json verify; rc_is 0; json 'd["ok"] is True and d["records_checked"] > 0 and d["problems"] == []'

# ---- write commands ----
t --db "$DB" leave 4; rc_is 0; out_has '^user 4: left the community layer \(left_at 20.*Z, [0-9]{19} ns\)$'
t --db "$DB" --json leave 4; rc_is 0; json 'd["changed"] is False and d["status"] == "Left" and d["action"] == "leave"'
t --db "$DB" status 4; out_has '^status +Left$'
t --db "$DB" rejoin 4; rc_is 0; out_has '^user 4: rejoined the community layer'
t --db "$DB" --json rejoin 4; rc_is 0; json 'd["changed"] is False and d["status"] == "Active" and d["left_at_ns"] > 0'
t --db "$DB" --json history 4; json '[e["event"] for e in d["events"]] == ["leave", "rejoin"]'

# ---- bulk leave with bad lines ----
printf '%s\n' 10 '' '# a comment' 11 abc -5 ' 12' 18446744073709551616 2 '13' >"$WORK/ids.txt"
printf '14\r\n' >>"$WORK/ids.txt"
printf '\t15  \n' >>"$WORK/ids.txt"  # surrounding blanks are ignored
t --db "$DB" leave --from "$WORK/ids.txt"; rc_is 1
out_has '^leave: 7 users processed from .*ids.txt: 6 left, 1 already Left; 3 bad lines$'
err_has "ids.txt:5: invalid user id 'abc'"; err_has "ids.txt:6: invalid user id '-5'"
err_has "ids.txt:8: invalid user id '18446744073709551616'"
checks=$((checks + 1)); ! grep -q "ids.txt:[0-9]*: invalid user id '[[:space:]]*\\(10\\|11\\|12\\|13\\|14\\|15\\|# a comment\\)[[:space:]]*'" "$ERR" || fail "a good line was reported bad"
checks=$((checks + 1)); ! grep -q $'\r' "$ERR" || fail "progress bar drawn on a non-tty stderr"
for u in 10 11 12 13 14 15; do t --db "$DB" status $u; out_has '^status +Left$'; done
t --db "$DB" --json list-left; json '[l["user_id"] for l in lines] == [2, 10, 11, 12, 13, 14, 15]'
# bulk from stdin, JSON, all good lines: exit 0
last="tidalctl --db $DB --json rejoin --from - <<< '10 11'"
printf '10\n11\n' | "$CTL" --db "$DB" --json rejoin --from - >"$OUT" 2>"$ERR"; rc=$?
rc_is 0; json 'd["source"] == "<stdin>" and d["processed"] == 2 and d["changed"] == 2 and d["bad_lines"] == [] and d["error"] is None and 0 < d["seconds"] < 60'
last="tidalctl --db $DB --json leave --from - (one bad line)"
printf '10\nx1\n' | "$CTL" --db "$DB" --json leave --from - >"$OUT" 2>"$ERR"; rc=$?
rc_is 1; json 'd["processed"] == 1 and d["bad_lines"] == [{"line": 2, "text": "x1", "error": "invalid user id"}]'
err_has "<stdin>:2: invalid user id 'x1'"

# ---- purge, receipts, rematerialize ----
t --db "$DB" purge; rc_is 2; err_has 'exactly one USER'
t --db "$DB" purge x; rc_is 2; err_has "invalid user id 'x'"
t --db "$DB" receipts 2 --repair; rc_is 2; err_has -- '--repair applies to rematerialize only'
t --db "$DB" purge 1; rc_is 1; err_has 'user 1 is Active'
t --db "$DB" purge 2; rc_is 0; out_has '^user 2: purged at .*: 0 ledger entries removed'
t --db "$DB" --json purge 2; rc_is 0; json 'd["user_id"] == 2 and d["entries_removed"] == 0 and d["left_at_ns"] > 0 and d["erasure_complete"] is True'
t --db "$DB" receipts 2; rc_is 0; out_has '^user 2: 0 purge receipts$'  # nothing removed: nothing written
t --db "$DB" --json receipts 2; rc_is 0; json 'd["user_id"] == 2 and d["receipts"] == []'
printf '%s\n' 2 ' 12 ' 1 zz '' 13 >"$WORK/purge.txt"
t --db "$DB" purge --from "$WORK/purge.txt"; rc_is 1
out_has '^purge: 3 users processed from .*purge.txt: 0 purged, 3 had nothing to remove; 2 bad lines$'
err_has 'purge.txt:3: 1: user is Active'; err_has "purge.txt:4: invalid user id 'zz'"
last="tidalctl --db $DB --json purge --from - <<< '12 13'"
printf '12\n13\n' | "$CTL" --db "$DB" --json purge --from - >"$OUT" 2>"$ERR"; rc=$?
rc_is 0; json 'd["action"] == "purge" and d["processed"] == 2 and d["bad_lines"] == [] and type(d["seconds"]) is float and 0 < d["seconds"] < 60'
t --db "$DB" changes; rc_is 0; out_has '^change_feed +off'
t --db "$DB" --json changes; rc_is 0; json 'd == {"change_feed": False}'
# A Db with a change feed: write commands go into its feed too.
FEEDDB=$WORK/feeddb
"$HOLDER" "$FEEDDB" --seed --feed 9 </dev/null >/dev/null || { echo "FAIL: could not seed $FEEDDB"; exit 1; }
t --db "$FEEDDB" --json changes; rc_is 0; json 'd["change_feed"] and d["shard_id"] == 9 and d["last_seq"] == 1 and d["pending_bytes"] > 0'
t --db "$FEEDDB" leave 4; rc_is 0
t --db "$FEEDDB" --strict-erasure receipts 4; rc_is 2; err_has -- '--strict-erasure applies to purge only'
t --db "$FEEDDB" --json --strict-erasure purge 4; rc_is 0; json 'd["entries_removed"] == 3 and d["erasure_complete"] is True'
t --db "$FEEDDB" changes; rc_is 0; out_has '^shard_id +9$'; out_has '^last_seq +2$'; out_has '^incarnation +[0-9a-f]{32}$'
inc=$("$CTL" --db "$FEEDDB" --json changes | python3 -c 'import json,sys; print(json.load(sys.stdin)["incarnation"])')
t --db "$FEEDDB" --json reseed; rc_is 0
json 'd["action"] == "reseed" and d["shard_id"] == 9 and d["first_seq"] == 3 and d["last_seq"] >= 3 and d["snapshot_bytes"] > 0 and len(d["incarnation"]) == 32 and d["incarnation"] != "'"$inc"'"'
t --db "$FEEDDB" reseed; rc_is 0; out_has '^reseed: shard 9 is incarnation [0-9a-f]{32} from seq 4;'
t --db "$FEEDDB" changes; rc_is 0; out_has '^trimmed_seq +3$'
# Backups: kept N, restored, recovering until finished.
mkdir -p "$WORK/backups"
t --db "$FEEDDB" backup "$WORK/backups"; rc_is 0; out_has '^backup: .*/backups/[0-9T.-]+Z \(files linked, [0-9.]+ s\)$'
sleep 0.01
t --db "$FEEDDB" --json backup "$WORK/backups"; rc_is 0; json 'd["action"] == "backup" and d["files"] == "linked" and d["deleted"] == []'
sleep 0.01
t --db "$FEEDDB" --json backup --keep 2 "$WORK/backups"; rc_is 0; json 'len(d["deleted"]) == 1'
[ "$(ls "$WORK/backups" | wc -l)" -eq 2 ] || fail "--keep 2 should leave 2 backups"
t --db "$FEEDDB" backup --keep 0 "$WORK/backups"; rc_is 2; err_has '--keep needs a number of backups, at least 1'
t --db "$FEEDDB" backup "$WORK/no-such-dir"; rc_is 1; err_has 'is not a directory'
t --db "$FEEDDB" status 4 --keep 2; rc_is 2; err_has '--keep applies to backup only'
newest=$(ls "$WORK/backups" | sort | tail -1)
t --db "$WORK/restored" restore "$WORK/backups/$newest"; rc_is 0; out_has 'It is recovering'
t --db "$WORK/restored" restore "$WORK/backups/$newest"; rc_is 2; err_has 'already exists'
t --db "$WORK/other" restore "$WORK"; rc_is 2; err_has 'is not a tidal backup'
t --db "$WORK/restored" status 4; rc_is 1; err_has 'recovering from a backup'
t --db "$WORK/restored" leave 5; rc_is 1; err_has 'recovering from a backup'
t --db "$WORK/restored" --json finish-recovery; rc_is 0; json 'd["was_recovering"] and len(d["incarnation"]) == 32'
t --db "$WORK/restored" finish-recovery; rc_is 0; out_has 'was not recovering'
t --db "$WORK/restored" status 4; rc_is 0; out_has 'Left'
[ -f "$WORK/backups/$newest/TIDAL_BACKUP" ] || fail "the restore must leave the backup as it was"
# A restore onto a file system without room for the files it copies is
# refused before it writes anything, naming the bytes; with room (another
# file system: every file copied) it succeeds.
if [ "$(id -u)" -eq 0 ] && mkdir -p "$WORK/small" "$WORK/roomy" &&
   mount -t tmpfs -o size=64k tidal-cli-test "$WORK/small" 2>/dev/null; then
  t --db "$WORK/small/restored" restore "$WORK/backups/$newest"; rc_is 1; err_has 'needs [0-9]+ bytes free'
  checks=$((checks + 1)); [ -z "$(ls -A "$WORK/small")" ] || fail "a refused restore left $(ls -A "$WORK/small")"
  umount "$WORK/small"
  if mount -t tmpfs -o size=32m tidal-cli-test "$WORK/roomy"; then
    t --db "$WORK/roomy/restored" restore "$WORK/backups/$newest"; rc_is 0; out_has '\(0 files linked'
    umount "$WORK/roomy"
  fi
else
  echo "SKIP: the restore's free-space check needs root (to mount a small tmpfs)"
fi
# A restore SIGKILLed before its n-th file or before its rename leaves no
# Db at the path (none without the manifest, which would open as a Db that
# is not recovering); the next restore removes the partial copy and succeeds.
nfiles=$(find "$WORK/backups/$newest" -type f | wc -l)
for at in 1 2 $((nfiles / 2)) "$nfiles" rename; do
  last="TIDAL_TEST_KILL_RESTORE_AT=$at tidalctl restore"
  (TIDAL_TEST_KILL_RESTORE_AT=$at "$CTL" --db "$WORK/killed-$at" restore "$WORK/backups/$newest" >"$OUT" 2>"$ERR") 2>/dev/null
  rc=$?
  rc_is 137
  checks=$((checks + 1)); [ ! -e "$WORK/killed-$at" ] || fail "a restore killed at $at left $WORK/killed-$at"
  t --db "$WORK/killed-$at" restore "$WORK/backups/$newest"; rc_is 0; out_has 'It is recovering'
  checks=$((checks + 1)); [ ! -e "$WORK/killed-$at.tidal-restore-tmp" ] || fail "the partial copy of the restore killed at $at is left"
  t --db "$WORK/killed-$at" status 4; rc_is 1; err_has 'recovering from a backup'
done
t --db "$WORK/restored" status 4 --nats nats://127.0.0.1:1; rc_is 2; err_has 'apply to restore only'
t --db "$WORK/restored3" restore "$WORK/backups/$newest" --journal-stream J; rc_is 2; err_has 'need --nats SERVERS'
[ ! -e "$WORK/restored3" ] || fail "a refused restore must not create its directory"
t --db "$DB" reseed; rc_is 1; err_has 'keeps no change feed'
# A Db with a change feed and a privacy journal: write commands go into both.
JDB=$WORK/journaldb
"$HOLDER" "$JDB" --seed --feed 9 --journal </dev/null >/dev/null || { echo "FAIL: could not seed $JDB"; exit 1; }
t --db "$JDB" leave 4; rc_is 0
t --db "$JDB" --json purge 4; rc_is 0; json 'd["entries_removed"] == 3'
t --db "$JDB" --prometheus stats; rc_is 0; out_has '^tidal_db_journal_last_seq\{.*\} 5$'; out_has '^tidal_db_journal_pending_entries\{.*\} 5$'
t --db "$DB" rematerialize; rc_is 0; out_has '^rematerialize: [0-9]+ aggregates checked, [0-9]+ ledger entries read, 0 mismatches$'
t --db "$DB" --json rematerialize --repair; rc_is 0; json 'd["mismatches"] == [] and d["repaired"] is False'

# ---- read-only while a host holds the Db; writes refused ----
FIFO=$WORK/hold.fifo
mkfifo "$FIFO"
"$HOLDER" "$DB" <"$FIFO" >"$WORK/holder.out" 2>&1 &
holder_pid=$!
exec 3>"$FIFO"
for _ in $(seq 100); do grep -q ready "$WORK/holder.out" && break; sleep 0.1; done
checks=$((checks + 1)); grep -q ready "$WORK/holder.out" || { rc=0; fail "db_holder did not start: $(cat "$WORK/holder.out")"; }
t --db "$DB" status 2; rc_is 0; out_has '^status +Left$'
t --db "$DB" --json list-left; rc_is 0; json '[l["user_id"] for l in lines] == [2, 10, 12, 13, 14, 15]'
t --db "$DB" verify; rc_is 0
t --db "$DB" leave 1; rc_is 1; err_has "cannot leave: the Db at '$DB' is held open read-write by another process"
err_has "pid $holder_pid holds"
t --db "$DB" rejoin 2; rc_is 1; err_has 'held open read-write'
t --db "$DB" leave --from "$WORK/ids.txt"; rc_is 1; err_has 'held open read-write'
exec 3>&-
wait "$holder_pid" || { rc=$?; fail "db_holder exited with an error: $(cat "$WORK/holder.out")"; }
t --db "$DB" status 1; out_has '^status +Active$'   # the refused leave changed nothing

# ---- verify finds corrupt records (and names their keys) ----
"$CORRUPT" "$DB" history || { echo "FAIL: could not corrupt $DB"; exit 1; }
t --db "$DB" history 7; rc_is 1; err_has 'history failed: Corruption: .*0000000000000007120000000000003039'
t --db "$DB" verify; rc_is 1; out_has '^verify: [0-9]+ records checked, 1 problems$'
"$CORRUPT" "$DB" leave || { echo "FAIL: could not corrupt $DB"; exit 1; }
t --db "$DB" verify; rc_is 1
out_has '^problem: users key 0000000000000007120000000000003039: .*0x12'
out_has '^problem: users key 000000000000000811: .*0x11.*does not decode'
out_has '^verify: [0-9]+ records checked, 2 problems$'
t --db "$DB" --json verify; rc_is 1; json 'd["ok"] is False and len(d["problems"]) == 2'
t --db "$DB" status 1; rc_is 1; err_has 'Corruption: .*user 8'
t --db "$DB" list-left; rc_is 1; err_has 'Corruption: .*user 8'

# ---- tidalctl view: a global view, read-only ----
VIEW=$WORK/view
"$VIEW_MAKER" "$VIEW" || { echo "FAIL: could not create $VIEW"; exit 1; }
before=$(fingerprint "$VIEW")
t view "$VIEW" applied; rc_is 0; out_has '^shard_id +applied_seq +incarnation$'; out_has '^\(0 shards\)$'
t --json view "$VIEW" applied; rc_is 0; json 'd == {"shards": []}'
t view "$VIEW" cohort 7 9; rc_is 0; out_has '^cohort_id +7$'; out_has '^item_id +9$'; out_has '^score +0$'
t view "$VIEW" --json community 18446744073709551615 0; rc_is 0
json 'd == {"community_id": 18446744073709551615, "item_id": 0, "score": 0}'
checks=$((checks + 1)); [ "$before" = "$(fingerprint "$VIEW")" ] || { rc=0; fail "tidalctl view changed files in $VIEW"; }
# Batches applied through the public API (payload bytes from docs/FORMAT.md).
for batch in "3 1 cohort 7 9 300000000" "1 1 community 5 6 -2500000000" "3 2 cohort 7 9 100000000"; do
  "$VIEW_MAKER" "$VIEW" $batch >/dev/null || { echo "FAIL: could not apply '$batch' to $VIEW"; exit 1; }
done
t view "$VIEW" applied; rc_is 0; out_has '^1 +1 +-$'; out_has '^3 +2 +-$'; out_has '^\(2 shards\)$'
t --json view "$VIEW" applied; rc_is 0
json 'd == {"shards": [{"shard_id": 1, "applied_seq": 1, "incarnation": ""}, {"shard_id": 3, "applied_seq": 2, "incarnation": ""}]}'
t view "$VIEW" cohort 7 9; rc_is 0; out_has '^score +0\.4$'   # 0.3 + 0.1, exact
t --prometheus view "$VIEW" applied; rc_is 0; out_has "^tidal_view_shards\\{view=\"$VIEW\"\\} 2$"
out_has "^tidal_view_applied_seq\\{view=\"$VIEW\",shard=\"3\"\\} 2$"
t --prometheus view "$VIEW" cohort 7 9; rc_is 2; err_has 'applies to stats and view PATH applied only'
t --json view "$VIEW" community 5 6; rc_is 0; json 'd["community_id"] == 5 and d["item_id"] == 6 and d["score"] == -2.5'
t --json view "$VIEW" cohort 5 6; rc_is 0; json 'd["score"] == 0'
# usage errors (exit 2, nothing opened)
t view; rc_is 2; err_has 'view needs a PATH'
t view "$VIEW"; rc_is 2; err_has 'view needs a PATH'
t view "$VIEW" frobnicate; rc_is 2; err_has "unknown view command 'frobnicate'"
t view "$VIEW" applied 1; rc_is 2; err_has 'takes no more arguments'
t view "$VIEW" cohort 7; rc_is 2; err_has 'takes exactly ID and ITEM'
t view "$VIEW" cohort x 9; rc_is 2; err_fixed "invalid cohort id 'x'"
t view "$VIEW" community 5 -6; rc_is 2; err_fixed "invalid item id '-6'"
t --db "$VIEW" view "$VIEW" applied; rc_is 2; err_has 'not --db'
# paths that are not a view (exit 2, nothing created)
t view "$WORK/no-view" applied; rc_is 2; err_has "global view at '$WORK/no-view'.*no such directory"
checks=$((checks + 1)); [ ! -e "$WORK/no-view" ] || fail "tidalctl view created $WORK/no-view"
mkdir "$WORK/empty-view"
t view "$WORK/empty-view" applied; rc_is 2; err_has 'holds no database'
checks=$((checks + 1)); [ -z "$(ls -A "$WORK/empty-view")" ] || fail "tidalctl view created files in $WORK/empty-view"
t view "$WORK/afile" cohort 1 1; rc_is 2; err_has 'regular file'
t view "$DB" applied; rc_is 2; err_has 'holds a tidal Db'
t --db "$VIEW" status 1; rc_is 2; err_has "lacks tidal's column families"   # a read-only Db open refuses a view

# migrate: a format-2 Db written by tidal 0.2 (tests/data/README.md)
mkdir -p "$WORK/f2" && tar -xzf "$FORMAT2" -C "$WORK/f2" || { echo "FAIL: cannot extract $FORMAT2"; exit 1; }
t --db "$WORK/f2/db" status 1003; rc_is 2; err_has 'format 2'; err_fixed "tidalctl migrate $WORK/f2/db"
checks=$((checks + 1)); [ ! -e "$WORK/f2/db/state" ] || fail "a read-only command upgraded the Db"
t --db "$WORK/f2/db" migrate; rc_is 0; out_has '^migrate: upgraded from format 2 to format 4$'
t --db "$WORK/f2/db" status 1003; rc_is 0; out_has 'Left'
t --db "$WORK/f2/db" --json receipts 1003; rc_is 0; out_has '"entries_removed": ?12'
t --db "$WORK/f2/db" --json migrate; rc_is 0; json 'd == {"format": 4, "upgraded": False}'
t --db "$WORK/f2/db" changes; rc_is 0; out_has '^last_seq +9$'
t --db "$WORK/f2/db" verify; rc_is 0

# --key-file: a write command wraps the bucket keys with the key; every open
# then needs it; rotate-key moves them to another key.
KEK=$WORK/kek.hex; KEK2=$WORK/kek2.bin
python3 -c "print('5a' * 32)" >"$KEK"
head -c 32 /dev/urandom >"$KEK2"
t --db "$WORK/f2/db" --key-file "$KEK" leave 1003; rc_is 0
t --db "$WORK/f2/db" status 1003; rc_is 2; err_has 'key_encryption_key is missing'
t --db "$WORK/f2/db" --key-file "$KEK2" status 1003; rc_is 2; err_has 'is not the one that wraps its bucket keys'
t --db "$WORK/f2/db" --key-file "$WORK/afile" status 1003; rc_is 2; err_has 'neither 32 bytes nor 64 hex digits'
t --db "$WORK/f2/db" --key-file "$KEK" verify; rc_is 0
t --db "$WORK/f2/db" --key-file "$KEK" rotate-key "$KEK2"; rc_is 0; out_has '^rotate-key: every bucket key is wrapped'
t --db "$WORK/f2/db" --key-file "$KEK" verify; rc_is 2; err_has 'is not the one'
t --db "$WORK/f2/db" --key-file "$KEK2" verify; rc_is 0
t --db "$WORK/f2/db" --key-file "$KEK2" rotate-key; rc_is 2; err_has 'rotate-key takes exactly one FILE'
t --db "$WORK/f2/db" --key-file; rc_is 2; err_has '--key-file needs a PATH'

echo "$checks checks, $failures failed"
[ "$failures" -eq 0 ]
