# Per-test ctest properties, read by ctest after gtest_discover_tests has
# listed the tests (TEST_INCLUDE_FILES of tests/ and tests/nats/; a name
# that is not there is ignored). scripts/test.sh runs ctest on every core.
#
# soak: the tests whose size is a round count (SIGKILL rounds, power cuts,
# the disaster drill, NATS kill rounds, the stride of the recovery sweep;
# tidal::testing::soak_rounds). They
# run in every tier, at a size that fits CI's budget by default and in full
# under scripts/test.sh --soak (TIDAL_SOAK=1); tests/RELIABILITY.md, "Test
# tiers", has both sizes.
set(tidal_soak_tests
  CrashTest.AcknowledgedLeavesAndRejoinsSurviveSigkill
  CrashTest.StampsStayBelowTheNextLeaveAfterSigkillAndAClockStepBack
  CrashTest.KillDuringOpenOf50kLeavers
  CrashTest.KillDuringIndexBackfillOf50kLeavers
  CrashTest.SignalsOutsideTheWritePeriodSurviveSigkill
  CrashTest.SignalsOutsideTheWritePeriodSurviveSigkillWhileScansRun
  CrashTest.TheCrashWindowHoldsUnderSustainedOverload
  CrashTest.TheChangeFeedHoldsExactlyWhatTheAggregatesHoldAfterEverySigkill
  CrashTest.PurgesAreAllOrNothingAndAcknowledgedOnesSurviveSigkill
  PowerLossTest.SignalsOutsideTheWritePeriodSurvivePowerCuts
  RecoverySweep.AReplayFailingAtAnyFileOperationForgetsNoPurgeOnceRetried)
set(tidal_nats_soak_tests
  NatsCrash.AShardKilledMidPublishLosesNoBatchAndPublishesNoneTwice
  NatsCrash.AFollowerKilledMidApplyLeavesTheViewExactAfterRestart
  NatsDrill.LosingAShardsMachineAndDiskForgetsNoAcknowledgedLeaveRejoinOrPurgeAndKeepsEveryViewExact)
set_tests_properties(${tidal_soak_tests} PROPERTIES LABELS soak)
set_tests_properties(${tidal_nats_soak_tests} PROPERTIES LABELS "nats;soak")

# COST: seconds in the main build (default tier, 2 cores), so that the
# longest start first on a fresh build directory; later runs use ctest's own
# record of the last times (Testing/Temporary/CTestCostData.txt).
foreach(entry
    "NatsDrill.LosingAShardsMachineAndDiskForgetsNoAcknowledgedLeaveRejoinOrPurgeAndKeepsEveryViewExact 40"
    "NatsCheckpoint.ANewViewFromACheckpointReadsOnlyWhatTheCheckpointLacks 41"
    "FaultSweepTest.OpenPersistent 40"
    "CrashTest.SignalsOutsideTheWritePeriodSurviveSigkill 28"
    "RecoverySweep.AReplayFailingAtAnyFileOperationForgetsNoPurgeOnceRetried 23"
    "CrashTest.TheCrashWindowHoldsUnderSustainedOverload 25"
    "package_consumer_subdirectory 25"
    "tidalctl_cli 30"
    "NatsOutage.PublisherAndFollowerRetryWithBoundedBackoffAndCatchUp 22"
    "PowerLossTest.SignalsOutsideTheWritePeriodSurvivePowerCuts 17"
    "CrashTest.PurgesAreAllOrNothingAndAcknowledgedOnesSurviveSigkill 15"
    "CrashTest.SignalsOutsideTheWritePeriodSurviveSigkillWhileScansRun 14"
    "NatsFence.ARestoredDbStopsWhereTheStreamIsNoLongerAheadAndNeverTrims 15"
    "package_consumer_package 15"
    "NatsCluster.ViewsConvergeBitForBitThroughServerKillAndPublisherRestart 14"
    "NatsCheckpoint.AShardReseededAfterTheCheckpointIsReadFromItsReseed 13"
    "Threads/LeaveStress.ConcurrentSignalsNeverContributeAfterLeaveReturns/64 12"
    "CrashTest.AcknowledgedLeavesAndRejoinsSurviveSigkill 11")
  string(REPLACE " " ";" entry "${entry}")
  list(GET entry 0 name)
  list(GET entry 1 cost)
  set_tests_properties("${name}" PROPERTIES COST ${cost})
endforeach()
