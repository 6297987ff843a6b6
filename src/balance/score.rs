//! The pick's seams: a [`Scorer`] gives each candidate a cost for this request, a [`Filter`] says
//! whether a candidate may take it at all, and a [`Pipeline`] is the weighted scorers and the filters a
//! pool picks with. [`SCORERS`] names every scorer a pipeline can be built from.
//!
//! A new scorer is a file beside `expected_latency.rs` with a type implementing [`Scorer`] and
//! `Default`, and one line in the `scorers!` list of `balance/mod.rs`, which declares its module and
//! registers it by name.

use std::cmp::Ordering;
use std::fmt;

use crate::config::{BalancePolicy, Config, Problem};
use crate::endpoint::{Endpoint, EngineNow};

use super::{PickContext, Registered, SCORERS};

/// How a scorer is made when a pipeline names it.
pub type MakeScorer = fn() -> Registered;

/// What the pick already read off an eligible endpoint, handed to every scorer: each reads it once.
#[derive(Clone, Copy, Debug)]
pub struct Sight<'e> {
    pub endpoint: &'e Endpoint,
    /// The endpoint's clock (see [`crate::endpoint::millis`]).
    pub now_ms: u64,
    /// Its weight after slow start, in thousandths.
    pub weight: u64,
    /// tongs' requests on it now.
    pub outstanding: u64,
    /// Its load by its own metrics, when they are fresh (see `endpoint::signals`).
    pub engine: Option<EngineNow>,
    /// Requests in it now: tongs' own, or all its metrics count when they count more.
    pub load: u64,
}

/// The denominator scorers whose cost is a factor near 1 give it over.
pub const FACTOR_ONE: u64 = 1 << 20;

/// A scorer's verdict on one endpoint for one request: lower is better. A fraction, so that a load
/// per unit of weight compares exactly (by cross-multiplication) when one scorer decides alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cost {
    pub numerator: u128,
    /// Never zero.
    pub denominator: u64,
}

impl Cost {
    /// The neutral factor: a scorer with nothing to say about a node.
    pub const ONE: Cost = Cost {
        numerator: 1,
        denominator: 1,
    };

    pub fn ratio(numerator: u128, denominator: u64) -> Cost {
        Cost {
            numerator,
            denominator: denominator.max(1),
        }
    }

    /// Exact order. At most 2^64 × 2^64 × 10^7 on each side would overflow; saturating keeps the order
    /// sane far beyond any real outstanding count and latency.
    pub fn cmp_exact(self, other: Cost) -> Ordering {
        self.numerator
            .saturating_mul(u128::from(other.denominator))
            .cmp(&other.numerator.saturating_mul(u128::from(self.denominator)))
    }

    pub fn as_f64(self) -> f64 {
        self.numerator as f64 / self.denominator as f64
    }
}

/// One way to rank endpoints: a pure function from an endpoint's state and the request to a cost.
pub trait Scorer: Send + Sync + fmt::Debug {
    /// Its name in [`SCORERS`] (and in the configuration).
    fn name(&self) -> &'static str;
    fn cost(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> Cost;
    /// What it reads beyond tongs' own state: without that, it scores every endpoint alike (1).
    fn reads(&self) -> Reads {
        Reads::Nothing
    }
}

/// What a scorer reads beyond tongs' own state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    Nothing,
    /// The endpoints' own metrics ([`Sight::engine`]).
    Signals,
    /// The request's affinity ([`PickContext::affinity`]).
    Affinity,
}

/// Whether an endpoint may take this request, beyond what every pick asks (its breaker, health, limit
/// and back-off: [`Endpoint::eligibility`]).
pub trait Filter: Send + Sync + fmt::Debug {
    fn name(&self) -> &'static str;
    fn admits(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> bool;
}

/// The filters and the weighted scorers a pool picks with.
///
/// With one scorer its costs compare exactly. With several, each gives a node a cost factor and the
/// node's cost is their product, each raised to its weight: scorers in different units (microseconds, shares of a cache) combine without
/// normalising, and a weight says how many doublings of one factor another's halving is worth.
#[derive(Debug, Default)]
pub struct Pipeline {
    filters: Vec<Box<dyn Filter>>,
    scorers: Vec<(Registered, f64)>,
    /// A scorer reads the request's affinity (its homes and prefix matches).
    affinity: bool,
    /// A weight is not a whole number up to 3: costs compare as logarithms.
    logarithms: bool,
    /// The one scorer that reads nothing beyond tongs' own state, when every other reads something: a
    /// pick with no signals and no affinity is its alone, compared exactly.
    plain: Option<usize>,
}

/// A name that is no scorer's.
#[derive(Debug, PartialEq, Eq)]
pub struct UnknownScorer(pub String);

impl fmt::Display for UnknownScorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no scorer is named {:?}; there are {}",
            self.0,
            known_names()
        )
    }
}

/// The registered scorers' names, listed for a reader.
fn known_names() -> String {
    let known: Vec<&str> = SCORERS.iter().map(|(name, _)| *name).collect();
    known.join(", ")
}

/// What only tongs can check of a configuration: that `balancer.scorers` names registered scorers
/// (the configuration crate does not know them). tongs loads and reloads its file with these checks
/// (`Config::load_with`, `Config::parse_with`), so a new scorer is registered in one place.
pub fn config_problems(config: &Config) -> Vec<Problem> {
    let Some(scorers) = &config.balancer.scorers else {
        return Vec::new();
    };
    scorers
        .keys()
        .filter(|name| !SCORERS.iter().any(|(known, _)| known == name))
        .map(|name| Problem {
            field: format!("balancer.scorers.{name}"),
            message: format!("is no scorer; there are {}", known_names()),
        })
        .collect()
}

impl Pipeline {
    /// The scorers named, each with its weight, and no filter.
    pub fn of(scorers: &[(&str, f64)]) -> Result<Pipeline, UnknownScorer> {
        let scorers = scorers
            .iter()
            .map(|&(wanted, weight)| {
                SCORERS
                    .iter()
                    .find(|(name, _)| *name == wanted)
                    .map(|(_, build)| (build(), weight))
                    .ok_or_else(|| UnknownScorer(wanted.to_owned()))
            })
            .collect::<Result<Vec<(Registered, f64)>, _>>()?;
        let affinity = scorers
            .iter()
            .any(|(scorer, _)| scorer.reads() == Reads::Affinity);
        let own: Vec<usize> = (0..scorers.len())
            .filter(|&at| scorers[at].0.reads() == Reads::Nothing)
            .collect();
        let plain = match own.as_slice() {
            [one] => Some(*one),
            _ => None,
        };
        let logarithms = scorers
            .iter()
            .any(|(_, weight)| ![1.0, 2.0, 3.0].contains(weight));
        Ok(Pipeline {
            filters: Vec::new(),
            scorers,
            affinity,
            logarithms,
            plain,
        })
    }

    /// What `balancer.policy` names: its one scorer.
    pub fn for_policy(policy: BalancePolicy) -> Pipeline {
        let name = match policy {
            BalancePolicy::ExpectedLatency => "expected-latency",
            BalancePolicy::LeastOutstanding => "least-outstanding",
        };
        Pipeline::of(&[(name, 1.0)]).expect("every policy names a registered scorer")
    }

    /// Adds a filter, asked after the built-in eligibility.
    pub fn with_filter(mut self, filter: Box<dyn Filter>) -> Pipeline {
        self.filters.push(filter);
        self
    }

    /// The scorers' names, in order.
    pub fn scorer_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.scorers.iter().map(|(scorer, _)| scorer.name())
    }

    /// The scorers' names and weights, in order.
    pub fn weights(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        self.scorers
            .iter()
            .map(|(scorer, weight)| (scorer.name(), *weight))
    }

    /// The filters' names, in order.
    pub fn filter_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.filters.iter().map(|filter| filter.name())
    }

    /// Whether a scorer reads the request's affinity, so the pick must work it out.
    pub fn uses_affinity(&self) -> bool {
        self.affinity
    }

    /// Whether every filter admits the endpoint.
    #[inline]
    pub fn admits(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> bool {
        self.filters.iter().all(|filter| filter.admits(sight, ctx))
    }

    /// The one scorer, when there is one.
    pub fn single(&self) -> Option<&Registered> {
        match self.scorers.as_slice() {
            [(scorer, _)] => Some(scorer),
            _ => None,
        }
    }

    /// The one scorer that decides a pick with neither signals nor affinity (the others all score
    /// 1 then), when there is one.
    pub fn plain(&self) -> Option<&Registered> {
        self.plain.map(|at| &self.scorers[at].0)
    }

    /// The endpoint's cost: the scorers' factors, each raised to its weight, multiplied; compared as
    /// its logarithm when a weight is not a whole number up to 3, so that no power overflows. A
    /// neutral factor (1) costs nothing, and whole weights up to 3 no power function.
    #[inline]
    pub fn weighted_product(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> f64 {
        let mut product = 1.0;
        let mut logarithm = 0.0;
        for (scorer, weight) in &self.scorers {
            let cost = scorer.cost(sight, ctx);
            if cost == Cost::ONE {
                continue;
            }
            let factor = cost.as_f64();
            match *weight {
                1.0 => product *= factor,
                2.0 => product *= factor * factor,
                3.0 => product *= factor * factor * factor,
                weight => logarithm += weight * factor.max(f64::MIN_POSITIVE).ln(),
            }
        }
        if self.logarithms {
            product.max(f64::MIN_POSITIVE).ln() + logarithm
        } else {
            product
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_compare_exactly_as_fractions() {
        assert_eq!(
            Cost::ratio(1, 1000).cmp_exact(Cost::ratio(2, 2000)),
            Ordering::Equal
        );
        assert_eq!(
            Cost::ratio(1, 3).cmp_exact(Cost::ratio(1, 2)),
            Ordering::Less
        );
        // A zero denominator is taken as one, never a division by zero.
        assert_eq!(Cost::ratio(5, 0), Cost::ratio(5, 1));
        // Far past any real load the order saturates rather than wraps.
        assert_eq!(
            Cost::ratio(u128::MAX, 1).cmp_exact(Cost::ratio(1, 1)),
            Ordering::Greater
        );
    }

    #[test]
    fn pipelines_are_built_by_name_and_unknown_names_are_refused_with_the_known_ones() {
        let both = Pipeline::of(&[("least-outstanding", 1.0), ("expected-latency", 0.5)]).unwrap();
        assert_eq!(
            both.scorer_names().collect::<Vec<_>>(),
            ["least-outstanding", "expected-latency"]
        );
        let err = Pipeline::of(&[("kv", 1.0)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no scorer is named \"kv\"; there are expected-latency, least-outstanding, queue, \
             kv-cache, prefix, session"
        );
        for (name, _) in SCORERS {
            assert_eq!(
                Pipeline::of(&[(name, 1.0)]).unwrap().scorer_names().next(),
                Some(*name)
            );
        }
        assert_eq!(
            Pipeline::for_policy(BalancePolicy::ExpectedLatency)
                .scorer_names()
                .collect::<Vec<_>>(),
            ["expected-latency"]
        );
    }

    #[test]
    fn a_configuration_naming_no_scorer_is_refused_with_the_field_and_the_known_names() {
        let text = "balancer: { scorers: { kv: 1, queue: 1 } }\npools:\n  - name: chat\n    \
                    match: { models: [chat] }\n    discovery: { static: [{ url: http://a:1 }] }\n    \
                    balancer: { scorers: { session: 1, nope: 2 } }\n";
        let err = Config::parse_with(text, "test", config_problems).unwrap_err();
        let crate::config::ConfigError::Invalid { problems, .. } = err else {
            panic!("{err}");
        };
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert!(fields.contains(&"balancer.scorers.kv"), "{fields:?}");
        assert!(
            fields.contains(&"pools[0].balancer.scorers.nope"),
            "{fields:?}"
        );
        assert!(
            problems[0].message.ends_with("kv-cache, prefix, session"),
            "{}",
            problems[0].message
        );
        // Without tongs' checks, the configuration crate takes any name.
        assert!(Config::parse(text, "test").is_ok());
        assert!(
            Config::parse_with(
                "balancer: { scorers: { queue: 1 } }",
                "test",
                config_problems
            )
            .is_ok()
        );
    }
}
