//! The deterministic simulation (`shoal::sim`): whole clusters in one thread on a simulated
//! network and clock, under seeded schedules of faults.
//!
//! - `fixed_seeds_find_no_violation`: the seeds CI runs (1 to 12 and the regressions), over the
//!   scenarios below.
//! - `mirror_reads_find_no_violation`: seeds 1 to 9 with every read balanced over mirrors.
//! - `maintenance_finds_no_violation`: seeds 1 to 6 of the maintenance scenario (five members,
//!   one goes into maintenance and stops, the other faults go on).
//! - `sigterm_finds_no_violation`: seeds 1 to 6 of the SIGTERM scenario (five members, any of
//!   them stopped as on SIGTERM and restarted later, the other faults go on).
//! - `several_writers_per_key_find_no_violation`: seeds 1 to 6 of the writers scenario (every
//!   client also writes four shared keys, whose histories are checked for linearizability).
//! - `every_fault_together_finds_no_violation`: seeds 1 to 8 of the mix scenario (five members,
//!   every fault together: forced leaves, maintenance, SIGTERM of one member and of all at once,
//!   kills whose Raft disk loses writes not yet flushed).
//! - `a_seed_replays_exactly`: the same seed twice gives the same digest.
//! - `sixty_four_nodes`: one run with 64 members.
//! - `many_seeds`: `SHOAL_SIM_SEEDS=N` runs N more seeds (from `SHOAL_SIM_FIRST_SEED`, default
//!   1000) and prints the failing ones; without it the test does nothing.
//! - `replay`: `SHOAL_SIM_SEED=S` runs seed S alone (with `RUST_LOG` for the nodes' logs).
//!
//! `tests/sim/soak.sh N` runs N fresh seeds through `replay`, one process each (a seed that
//! hangs is stopped and reported), and prints every failing one with its replay command.
//!
//! `SHOAL_SIM_READ=mirrors` makes `many_seeds` and `replay` balance every read over mirrors;
//! `SHOAL_SIM_SCENARIO=maintenance` (or `membership`, `stop`, `writers`, `mix`) makes them run
//! that scenario.

use std::time::Duration;

use shoal::sim::{self, Faults, Report, Scenario};
use shoal_http_api::types::ReadFrom;

fn scenarios() -> Vec<Scenario> {
    let base = Scenario {
        name: "three nodes, every fault",
        nodes: 3,
        max_hosts: 5,
        duration: Duration::from_secs(40),
        clients: 4,
        keys: 12,
        faults: Faults::ALL,
        converge_within: Duration::from_secs(120),
        read_from: ReadFrom::Owner,
        shared_keys: 0,
    };
    vec![
        base.clone(),
        Scenario { name: "five nodes, every fault", nodes: 5, max_hosts: 7, ..base.clone() },
        Scenario {
            name: "three nodes, kills and joins",
            faults: Faults { partition: false, drops: false, ..Faults::ALL },
            ..base
        },
    ]
}

/// Five members, one of which the schedule may put into maintenance and stop, while the other
/// faults go on (kills of other members, splits, joins and leaves, lost and slow messages).
fn maintenance_scenario() -> Scenario {
    Scenario {
        name: "five nodes, maintenance and every fault",
        nodes: 5,
        max_hosts: 7,
        faults: Faults { maintenance: true, ..Faults::ALL },
        ..scenarios()[0].clone()
    }
}

/// Five members, any of which the schedule may stop as SIGTERM does (and restart later), while
/// the other faults go on.
fn stop_scenario() -> Scenario {
    Scenario {
        name: "five nodes, SIGTERM and every fault",
        faults: Faults { stop: true, ..Faults::ALL },
        ..maintenance_scenario()
    }
}

/// Nothing but joins and leaves, with more keys and clients than the others: every operation
/// must succeed while buckets move, but those sent to a node that leaves.
fn membership_scenario() -> Scenario {
    Scenario {
        name: "three to six nodes, only joins and leaves",
        max_hosts: 6,
        clients: 8,
        keys: 24,
        faults: Faults {
            kill: false,
            partition: false,
            membership: true,
            drops: false,
            delays: false,
            maintenance: false,
            stop: false,
            full_stop: false,
            forced_leave: false,
            disk_loss: false,
        },
        ..scenarios()[0].clone()
    }
}

/// Five members under every fault together: kills (whose Raft disk may lose the writes it had
/// not flushed), splits, joins and leaves, forced leaves, maintenance, SIGTERM of one member and
/// of all of them at once (a majority back first).
fn mix_scenario() -> Scenario {
    Scenario { name: "five nodes, every fault together", faults: Faults::EVERY, ..maintenance_scenario() }
}

/// Three members under every fault, and four keys every client writes (besides their own):
/// their histories are checked for linearizability.
fn writers_scenario() -> Scenario {
    Scenario { name: "three nodes, several writers per key, every fault", shared_keys: 4, ..scenarios()[0].clone() }
}

/// The scenario of seed `seed` (`SHOAL_SIM_SCENARIO=maintenance` or `membership`: that
/// scenario).
fn scenario_of(seed: u64) -> Scenario {
    let all = scenarios();
    let scenario = match std::env::var("SHOAL_SIM_SCENARIO").as_deref() {
        Ok("maintenance") => maintenance_scenario(),
        Ok("membership") => membership_scenario(),
        Ok("stop") => stop_scenario(),
        Ok("writers") => writers_scenario(),
        Ok("mix") => mix_scenario(),
        _ => all[(seed as usize) % all.len()].clone(),
    };
    let read_from = match std::env::var("SHOAL_SIM_READ").as_deref() {
        Ok("mirrors") => ReadFrom::Mirrors,
        _ => ReadFrom::Owner,
    };
    Scenario { read_from, ..scenario }
}

fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_timer(sim::SimTime)
            .with_ansi(false)
            .with_test_writer()
            .try_init();
    }
}

/// Runs `seeds` on two threads; answers the reports of the failing ones.
fn run_all(seeds: Vec<u64>) -> (usize, Vec<Report>) {
    run_all_in(seeds, &scenario_of)
}

/// [`run_all`], each seed in the scenario `scenario` gives it.
fn run_all_in(seeds: Vec<u64>, scenario: &(dyn Fn(u64) -> Scenario + Sync)) -> (usize, Vec<Report>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let chunks: Vec<Vec<u64>> = (0..2).map(|i| seeds.iter().copied().skip(i).step_by(2).collect()).collect();
    std::thread::scope(|s| {
        for chunk in chunks {
            let tx = tx.clone();
            s.spawn(move || {
                for seed in chunk {
                    let report = sim::run(seed, &scenario(seed));
                    eprintln!("{}", report.summary());
                    if !report.violations().is_empty() {
                        // At once, so a long run shows its failing seeds before it ends.
                        eprintln!("FAILED {}", sim::explain(&report));
                    }
                    let _ = tx.send(report);
                }
            });
        }
    });
    drop(tx);
    let reports: Vec<Report> = rx.into_iter().collect();
    let ran = reports.len();
    (ran, reports.into_iter().filter(|r| !r.violations().is_empty()).collect())
}

fn assert_clean(ran: usize, failed: &[Report]) {
    let explained: Vec<String> = failed.iter().map(sim::explain).collect();
    assert!(failed.is_empty(), "{} of {ran} seeds failed:\n{}", failed.len(), explained.join("\n"));
}

#[test]
fn fixed_seeds_find_no_violation() {
    init_logs();
    assert!(
        sim::replays_exactly(),
        "build with --cfg tokio_unstable (.cargo/config.toml sets it) so that seeds replay exactly"
    );
    let (ran, failed) = run_all((1..=12).chain(REGRESSIONS.iter().copied()).collect());
    assert_clean(ran, &failed);
}

/// Every read goes to a mirror of its bucket (its owner or the holder of its replica): under
/// kills, splits, joins and leaves no read sees a value older than an acknowledged write.
#[test]
fn mirror_reads_find_no_violation() {
    init_logs();
    let mirrors = |seed| Scenario { read_from: ReadFrom::Mirrors, ..scenario_of(seed) };
    let (ran, failed) = run_all_in((1..=9).chain(MIRROR_REGRESSIONS.iter().copied()).collect(), &mirrors);
    assert_clean(ran, &failed);
}

/// Seeds that once found a bug, kept so that it stays fixed: 106 (a bucket moved to a node
/// failed meanwhile), 124 (a leave asked of a leader cut off from its majority never
/// answered), 197 (a rebuilt replica left buckets served empty after a restart), 1541 (a
/// node that restarted after handing a bucket over adopted its "shadow", empty, on a
/// failover), 1275 (the checker did not let a read see its bucket emptied while it ran), 1594
/// (stopping members gave their Raft votes away until two voters were left, one of which
/// then died: no majority ever again), 6082 (the only member left was killed and restarted:
/// its buckets served again empty without saying so), 26854 (a restarted member cut off while
/// the cluster failed it asked its heir for its buckets back after the heal; the heir, which
/// served them by then, said it held no copy, and the member served them again empty), 3048
/// (the owner of a lost bucket took its copy back and was killed before `Found` committed; it
/// committed the entry itself once it restarted, and served the bucket from its empty memory),
/// 53440 (a pull outlived its move: its source was cut off and failed, the bucket was promoted
/// at the puller and written there; after the heal the source answered the pull with its old
/// copy, which went into the bucket the puller served and brought back an overwritten value),
/// 1048 (a split healed with two of three voters on the side that lost the failure vote: both
/// were failed before the voters moved away from the first, and the voters in force never had
/// a majority again), 50100, 50170 and 50278 (a sync write whose replica gave no answer was
/// taken back and answered `replication_failed`, "nothing was stored"; the replica had applied
/// it, its owner was failed before its next write of the bucket, and the promoted replica served
/// the write), 60262 (a retired leader whose Raft had stopped waited for its last entries on the
/// closed metrics channel in a loop that never slept: simulated time froze, and the node never
/// stopped).
const REGRESSIONS: &[u64] =
    &[106, 124, 197, 1048, 1275, 1541, 1594, 3048, 6082, 26854, 50100, 50170, 50278, 53440, 60262];

/// Seeds that once found a bug with every read balanced over mirrors: 8554 (a new owner
/// acknowledged writes its shadow missed; the owner and its replica holder were then cut off
/// together, and the bucket came back from the shadow without them).
const MIRROR_REGRESSIONS: &[u64] = &[8554];

/// A member goes into maintenance and stops while the other faults go on: no acknowledged
/// write is lost when it comes back, or when another member fails meanwhile.
#[test]
fn maintenance_finds_no_violation() {
    init_logs();
    let (ran, failed) = run_all_in((1..=6).collect(), &|_| maintenance_scenario());
    assert_clean(ran, &failed);
    for &seed in MAINTENANCE_REGRESSIONS {
        let report = sim::run(seed, &maintenance_scenario());
        assert!(report.violations().is_empty(), "{}", sim::explain(&report));
        assert_eq!(report.emptied, 0, "no copy died, yet buckets were served again empty:\n{}", sim::explain(&report));
    }
}

/// Seeds of the maintenance scenario that once found a bug: 128 (the member back from
/// maintenance, still catching up after its restart, restored a bucket it had just pulled back
/// from its heir; the heir, now its shadow, held no replica of it, so the member dropped its copy
/// and served the bucket again empty) and 332 (the request went through a node that left and
/// stopped before it passed the answer on: the member went away, the simulation took it for
/// refused, never stopped it, and it stayed away for its whole period). Nothing in their
/// schedules kills every copy of a bucket: no bucket may be served again empty.
const MAINTENANCE_REGRESSIONS: &[u64] = &[128, 332];

/// Members stopped as SIGTERM does while the other faults go on: no acknowledged write is lost,
/// whether the stop's maintenance was kept or the cluster failed the member.
#[test]
fn sigterm_finds_no_violation() {
    init_logs();
    let (ran, failed) = run_all_in((1..=6).chain(SIGTERM_REGRESSIONS.iter().copied()).collect(), &|_| stop_scenario());
    assert_clean(ran, &failed);
}

/// Seeds of the SIGTERM scenario that once found a bug: 125 (buckets lost in a split went to a
/// member that was then stopped and failed; its heir said they served again, empty, as if their
/// copy had died in the stop, while Raft kept them lost for their last server to give back, as
/// it then did: the simulation took the copy given back for a value come back from the dead).
const SIGTERM_REGRESSIONS: &[u64] = &[125];

/// With only joins and leaves, every operation succeeds but those sent to a leaving node.
#[test]
fn membership_finds_no_violation() {
    init_logs();
    let seeds = (1..=4).chain(MEMBERSHIP_REGRESSIONS.iter().copied()).collect();
    let (ran, failed) = run_all_in(seeds, &|_| membership_scenario());
    assert_clean(ran, &failed);
}

/// Seeds of the membership scenario that once found a bug: 7 (a node forwarded a write to a
/// node that had just left, which refused it instead of sending it on), 27 and 112 (a leader
/// that left stopped before the others knew its last commits; a write replicated to one of
/// them waited for the next leader past the sender's timeout).
const MEMBERSHIP_REGRESSIONS: &[u64] = &[7, 27, 112];

/// Seeds of the writers scenario that found a bug: 5006 (a write answered `replication_failed`
/// whose shadow could not be told to take it back came back when the owner restored the
/// bucket from that shadow).
const WRITERS_REGRESSIONS: &[u64] = &[5006];

#[test]
fn several_writers_per_key_find_no_violation() {
    init_logs();
    let seeds = (1..=6).chain(WRITERS_REGRESSIONS.iter().copied()).collect();
    let (ran, failed) = run_all_in(seeds, &|_| writers_scenario());
    assert_clean(ran, &failed);
}

/// Every fault together, a full stop with a majority back first included: no acknowledged
/// write lost, no read back in time, and the cluster converges.
#[test]
fn every_fault_together_finds_no_violation() {
    init_logs();
    let seeds = (1..=8).chain(MIX_REGRESSIONS.iter().copied()).collect();
    let (ran, failed) = run_all_in(seeds, &|_| mix_scenario());
    assert_clean(ran, &failed);
}

/// Seeds of the mix scenario that found a flaw of the simulation itself: 7 (a host added while
/// every member was stopped bootstrapped a second cluster) and 1026 (a host added while one
/// member ran could join only through it, and it left for good).
const MIX_REGRESSIONS: &[u64] = &[7, 1026];

#[test]
fn a_seed_replays_exactly() {
    let scenario = Scenario { duration: Duration::from_secs(20), ..scenario_of(0) };
    let first = sim::run(4242, &scenario);
    let second = sim::run(4242, &scenario);
    assert!(first.operations > 100, "the clients ran: {}", first.summary());
    assert_eq!(first.digest, second.digest, "\n{}\n{}", sim::explain(&first), sim::explain(&second));
}

#[test]
fn sixty_four_nodes() {
    init_logs();
    let scenario = Scenario {
        name: "sixty-four nodes",
        nodes: 64,
        max_hosts: 64,
        duration: Duration::from_secs(20),
        clients: 4,
        keys: 16,
        faults: Faults { membership: false, drops: false, delays: false, ..Faults::ALL },
        converge_within: Duration::from_secs(180),
        read_from: ReadFrom::Owner,
        shared_keys: 0,
    };
    let report = sim::run(64, &scenario);
    eprintln!("{}", report.summary());
    assert_clean(1, &[report].into_iter().filter(|r| !r.violations().is_empty()).collect::<Vec<_>>());
}

#[test]
fn many_seeds() {
    let Some(n) = std::env::var("SHOAL_SIM_SEEDS").ok().and_then(|v| v.parse::<u64>().ok()) else { return };
    init_logs();
    let first = std::env::var("SHOAL_SIM_FIRST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let (ran, failed) = run_all((first..first + n).collect());
    eprintln!("{ran} seeds run, {} failed", failed.len());
    assert_clean(ran, &failed);
}

#[test]
fn replay() {
    let Some(seed) = std::env::var("SHOAL_SIM_SEED").ok().and_then(|v| v.parse::<u64>().ok()) else { return };
    init_logs();
    let report = sim::run(seed, &scenario_of(seed));
    eprintln!("{}", sim::explain(&report));
    assert!(report.violations().is_empty(), "seed {seed} failed");
}
