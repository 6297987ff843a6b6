//! `tongs demo`: a simulated interruptible GPU fleet, a tongs proxy in front of it (same process, real
//! sockets), and an open-loop load generator, with a live table and a summary.

mod load;
mod report;
mod schedule;

use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use load::{
    AnswerFault, COMPLETION_TOKENS, ClientOutcome, LoadGenerator, LoadPlan, Recorder,
    build_request, check_completion, expected_text,
};
pub use report::Summary;
pub use schedule::{HEADROOM, Shortfall, shortfall};

use crate::config::{BalancePolicy, Config, HumanDuration, LimitMode, StaticEndpoint};
use crate::sim::{
    EngineSpec, FirstToken, Fleet, FleetConfig, Interruption, InterruptionKind, NodeSpec,
    Preemption, RandomInterruptions,
};
use crate::{App, AppError};

/// What `tongs demo` was asked for.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub duration: Duration,
    pub nodes: usize,
    pub rps: f64,
    pub seed: u64,
    /// Print the final summary as one JSON line on stdout (the live table goes to stderr).
    pub json: bool,
    /// Inject interruptions (off gives the same fleet calm, as a baseline).
    pub interruptions: bool,
    /// How tongs ranks the nodes.
    pub policy: BalancePolicy,
    /// Per-node concurrency limit (static: 4 each).
    pub limit: LimitMode,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            duration: Duration::from_secs(30),
            nodes: 6,
            rps: 40.0,
            seed: 1,
            json: false,
            interruptions: true,
            policy: BalancePolicy::default(),
            limit: LimitMode::Learned,
        }
    }
}

/// GPU classes of a mixed SaladCloud fleet: name, mean service time, requests served at once.
const PROFILES: [(&str, u64, usize); 6] = [
    ("a100", 120, 8),
    ("l40s", 180, 6),
    ("rtx4090", 250, 4),
    ("rtx3090", 350, 4),
    ("rtx3080", 500, 2),
    ("rtx3060", 700, 2),
];

/// The pauses of a node of the [`PROFILES`] at `profile`: the two slowest consumer GPUs wait
/// 400 ms and 500 ms for a first token (more with each other request in flight) and are now and then
/// preempted for 2 to 3 s, the chance growing with load. Healthy behaviour, not interruptions, so a
/// calm run has them too.
fn pauses(profile: usize) -> Option<(FirstToken, Preemption)> {
    let (wait, per_in_flight, chance, pause) = match profile {
        4 => (400, 30, 0.03, 2_500),
        5 => (500, 40, 0.05, 2_000),
        _ => return None,
    };
    let first_token = FirstToken {
        wait: HumanDuration::from_millis(wait),
        per_prompt_word: HumanDuration::from_millis(2),
        per_in_flight: HumanDuration::from_millis(per_in_flight),
        spread: 0.2,
    };
    let preemption = Preemption {
        chance,
        per_in_flight: chance,
        pause: HumanDuration::from_millis(pause),
        spread: 0.2,
    };
    Some((first_token, preemption))
}

/// Requests tongs lets each demo node hold at once under `--limit static`
/// (`concurrency.max_outstanding_per_endpoint`; the adaptive limit's starting value).
pub const PER_NODE_LIMIT: u32 = 4;

impl DemoOptions {
    /// The per-node limit that bounds what a node serves: only a static one (an adaptive limit learns
    /// the node's capacity; `none` has none).
    fn static_limit(&self) -> Option<usize> {
        (self.limit == LimitMode::Static).then_some(PER_NODE_LIMIT as usize)
    }
}

/// The demo fleet: heterogeneous nodes, each interruption kind once on a fixed schedule spread over
/// the run, one after another (so every run with as many nodes as kinds shows them all), plus seeded
/// random interruptions, about two per node per run, of which only those are kept that leave the
/// fleet enough capacity for the load ([`schedule`]: fewer where they would overlap a fixed one or
/// take out too much of the fleet at once). The two
/// slowest GPUs pause as real inference servers do ([`pauses`]): a 400 to 600 ms wait for the first
/// token, and now and then a stream preempted for 2 to 3 s. The slowest, so that the fleet's capacity
/// hardly changes: they serve about 4 requests a second instead of 7 together.
pub fn demo_fleet(options: &DemoOptions) -> FleetConfig {
    let run = options.duration.as_secs_f64();
    let nodes = (0..options.nodes.max(1))
        .map(|i| {
            let (gpu, mean_ms, capacity) = PROFILES[i % PROFILES.len()];
            let mut spec = NodeSpec::new(&format!("{gpu}-{i}"), Duration::from_millis(mean_ms));
            spec.capacity = capacity;
            spec.queue = capacity * 4;
            // Paced for the tokens the load asks for, a stream lasts about its service time.
            spec.tokens = COMPLETION_TOKENS;
            spec.report_load = true;
            // A continuous-batching server: its batch is its capacity, the rest wait in its own queue,
            // and its /metrics says so (tongs reads it: the table's queue and KV columns). Its KV cache
            // is sized so that a full batch of the load's short requests fills about half of it.
            spec.engine = Some(EngineSpec {
                kv_blocks: capacity * 4,
                ..EngineSpec::default()
            });
            if let Some((first_token, preemption)) = pauses(i % PROFILES.len()) {
                spec.first_token = Some(first_token);
                spec.preemption = Some(preemption);
            }
            if !options.interruptions {
                return spec;
            }
            if i < InterruptionKind::ALL.len() {
                // Fixed: one after another from 15 % of the run, each lasting 12 % of it.
                let kind = InterruptionKind::ALL
                    [(i + options.seed as usize) % InterruptionKind::ALL.len()];
                spec.interruptions.push(Interruption {
                    kind,
                    at: HumanDuration(Duration::from_secs_f64(run * (0.15 + 0.15 * i as f64))),
                    duration: HumanDuration(Duration::from_secs_f64(run * 0.12)),
                    factor: 6.0,
                    notice: None,
                });
            } else if i == InterruptionKind::ALL.len() {
                // And one that announces itself, as a node told to stop does (its SIGTERM hook): it
                // says it goes a while ahead, then goes (refuse). tongs drains it and moves its
                // streams before then.
                spec.interruptions.push(Interruption {
                    kind: InterruptionKind::Refuse,
                    at: HumanDuration(Duration::from_secs_f64(run * 0.5)),
                    duration: HumanDuration(Duration::from_secs_f64(run * 0.12)),
                    factor: 1.0,
                    notice: Some(HumanDuration(Duration::from_secs_f64(
                        (run * 0.15).clamp(2.0, 10.0),
                    ))),
                });
            }
            // About two per node in a run of any length (at most one every 90 s in a long one), so a
            // 30 s run meets them too.
            let scaled = |share: f64, low: f64, high: f64| {
                HumanDuration(Duration::from_secs_f64((run * share).clamp(low, high)))
            };
            spec.random_interruptions = Some(RandomInterruptions {
                mean_interval: scaled(0.5, 5.0, 90.0),
                mean_duration: scaled(0.1, 2.0, 6.0),
                kinds: InterruptionKind::ALL.to_vec(),
                slow_factor: 6.0,
            });
            spec
        })
        .collect();
    let mut fleet = FleetConfig {
        seed: options.seed,
        nodes,
    };
    if options.interruptions {
        schedule::keep_capacity(
            &mut fleet,
            options.duration,
            options.rps,
            options.static_limit(),
        );
    }
    fleet
}

/// The proxy configuration the demo runs: the fleet as static endpoints, loopback ports, and timeouts
/// short enough that a silent node shows up within the run.
pub fn demo_config(fleet: &Fleet, options: &DemoOptions) -> Config {
    let mut config = Config {
        listen: ([127, 0, 0, 1], 0).into(),
        ..Config::default()
    };
    config.admin.listen = ([127, 0, 0, 1], 0).into();
    config.balancer.policy = options.policy;
    config.concurrency.limit = options.limit;
    config.concurrency.max_outstanding_per_endpoint = PER_NODE_LIMIT;
    config.queue.max_wait = HumanDuration::from_secs(10);
    config.timeouts.connect = HumanDuration::from_secs(1);
    config.timeouts.response_headers = HumanDuration::from_secs(10);
    config.timeouts.total = HumanDuration::from_secs(30);
    config.discovery.static_endpoints = fleet
        .urls()
        .into_iter()
        .map(|url| StaticEndpoint {
            url,
            weight: 1,
            max_outstanding: None,
            engine: None,
        })
        .collect();
    config
}

/// Why the demo could not start.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot start the simulated fleet: {0}")]
    Fleet(std::io::Error),
    #[error("cannot start tongs in front of the fleet: {0}")]
    Proxy(#[from] AppError),
}

/// Runs the whole demo and returns its summary.
pub async fn run(options: DemoOptions, interrupt: CancellationToken) -> Result<Summary, DemoError> {
    let fleet_config = demo_fleet(&options);
    let fleet = Fleet::start(&fleet_config, options.duration)
        .await
        .map_err(DemoError::Fleet)?;
    let app = App::bind(&demo_config(&fleet, &options)).await?;
    let parts = app.parts().clone();
    let target = format!("http://{}", app.proxy_addr());
    let proxy_stop = CancellationToken::new();
    let proxy_task = tokio::spawn(app.run(proxy_stop.clone()));

    let generator = LoadGenerator::default();
    let plan = LoadPlan {
        target,
        rps: options.rps,
        duration: options.duration,
        stream_every: 3,
        client_timeout: Duration::from_secs(60),
        settle: Duration::from_secs(15),
    };
    let live = report::Live::new(if options.json {
        report::Sink::Stderr
    } else {
        report::Sink::Stdout
    });
    let interactive = live.is_terminal();
    let refresh = if interactive {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    let started = tokio::time::Instant::now();
    {
        let load = generator.run(&plan, interrupt.clone());
        tokio::pin!(load);
        let mut ticker = tokio::time::interval(refresh);
        let mut live = live;
        loop {
            tokio::select! {
                () = &mut load => break,
                _ = ticker.tick() => {
                    let view = report::snapshot(&fleet, &parts, &generator, started.elapsed());
                    live.show(&view);
                }
            }
        }
        let view = report::snapshot(&fleet, &parts, &generator, started.elapsed());
        live.show(&view);
        live.finish();
    }
    let capacity = shortfall(&fleet_config, options.rps, options.static_limit());
    let summary = Summary::collect(
        &options,
        &fleet,
        &parts,
        &generator,
        started.elapsed(),
        capacity,
    );
    proxy_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), proxy_task).await;
    drop(fleet);
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random interruptions in a run of the demo's defaults (seeds 1 to 5): the fixed ones aside, how
    /// many fall inside the run and are kept, over the whole fleet.
    fn random_in_run(options: &DemoOptions) -> Vec<usize> {
        (1..=5)
            .map(|seed| {
                let options = DemoOptions {
                    seed,
                    ..options.clone()
                };
                let fleet = demo_fleet(&options);
                let planned: usize = fleet.planned(options.duration).iter().map(Vec::len).sum();
                // One of each kind, and the announced one on the next node.
                let fixed = options.nodes.min(InterruptionKind::ALL.len() + 1);
                planned - fixed
            })
            .collect()
    }

    #[test]
    fn the_demo_fleet_is_valid_and_two_nodes_pause() {
        for interruptions in [true, false] {
            let fleet = demo_fleet(&DemoOptions {
                interruptions,
                ..DemoOptions::default()
            });
            assert_eq!(fleet.validate(), []);
            let pausing: Vec<&str> = fleet
                .nodes
                .iter()
                .filter(|spec| spec.first_token.is_some() && spec.preemption.is_some())
                .map(|spec| spec.name.as_str())
                .collect();
            assert_eq!(pausing, ["rtx3080-4", "rtx3060-5"]);
        }
    }

    #[test]
    fn a_run_of_20_s_or_more_meets_random_interruptions_too() {
        for seconds in [20, 30, 60] {
            let options = DemoOptions {
                duration: Duration::from_secs(seconds),
                ..DemoOptions::default()
            };
            let counts = random_in_run(&options);
            eprintln!("random interruptions in a {seconds} s run, seeds 1-5: {counts:?}");
            assert!(
                counts.iter().all(|&n| n >= options.nodes / 2),
                "{seconds} s: about two per node, less overlaps: {counts:?}"
            );
        }
    }

    /// The demo's own load never meets a fleet too small for it: whatever the seed, the interruptions
    /// leave at least the headroom over the load at every moment, so every refusal would be tongs'.
    #[test]
    fn the_default_demo_keeps_capacity_for_its_load() {
        for seed in 1..=10 {
            let options = DemoOptions {
                seed,
                ..DemoOptions::default()
            };
            let fleet = demo_fleet(&options);
            let short = shortfall(&fleet, options.rps * HEADROOM, options.static_limit());
            assert_eq!(short.seconds, 0.0, "seed {seed}: {short:?}");
            assert!(
                short.lowest_rps < short.capacity_rps,
                "seed {seed}: {short:?}"
            );
        }
    }
}
