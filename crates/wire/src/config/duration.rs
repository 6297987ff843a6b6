//! Durations as people write them in YAML: `250ms`, `2s`, `100s`, `1m 30s`.
//!
//! A bare number is refused on purpose: `timeout: 100` could mean seconds or milliseconds, and a proxy
//! that guesses wrong fails requests for a reason nobody can see.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A [`Duration`] that reads and writes itself in humantime form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn from_secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }

    pub const fn from_millis(millis: u64) -> Self {
        Self(Duration::from_millis(millis))
    }

    pub const fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Display for HumanDuration {
    /// Whole seconds as `100s`, whole milliseconds as `250ms` (how the config file is written), anything
    /// else in humantime's `1s 500us` form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}", humantime::format_duration(d))
        }
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = HumanDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration with a unit, such as 250ms, 2s or 100s")
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
                humantime::parse_duration(value.trim())
                    .map(HumanDuration)
                    .map_err(|err| {
                        E::custom(format!(
                            "invalid duration {value:?}: {err} (write it with a unit, e.g. 250ms, 2s, 100s)"
                        ))
                    })
            }

            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "duration {value} has no unit: write e.g. {value}s or {value}ms"
                )))
            }

            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "duration {value} has no unit: write e.g. {value}s or {value}ms"
                )))
            }

            fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "duration {value} has no unit: write e.g. {value}s or {value}ms"
                )))
            }
        }

        deserializer.deserialize_any(DurationVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Holder {
        d: HumanDuration,
    }

    #[test]
    fn parses_units() {
        for (text, expected) in [
            ("250ms", Duration::from_millis(250)),
            ("2s", Duration::from_secs(2)),
            ("100s", Duration::from_secs(100)),
            ("1m 30s", Duration::from_secs(90)),
        ] {
            let holder: Holder = serde_saphyr::from_str(&format!("d: {text}\n")).unwrap();
            assert_eq!(holder.d.get(), expected, "{text}");
        }
    }

    #[test]
    fn refuses_bare_numbers_and_garbage() {
        for text in ["100", "2.5", "soon", "-3s"] {
            let result: Result<Holder, _> = serde_saphyr::from_str(&format!("d: {text}\n"));
            assert!(result.is_err(), "{text} should be refused");
        }
    }

    #[test]
    fn round_trips_through_display() {
        for (d, text) in [
            (HumanDuration::from_millis(1500), "1500ms"),
            (HumanDuration::from_secs(100), "100s"),
            (HumanDuration(Duration::from_micros(1500)), "1ms 500us"),
        ] {
            assert_eq!(d.to_string(), text);
            assert_eq!(humantime::parse_duration(&d.to_string()).unwrap(), d.get());
        }
    }
}
