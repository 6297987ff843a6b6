//! Kubernetes label selectors in their string form (`app=llm,tier in (a,b),!canary`), parsed into
//! their requirements.
//!
//! Pools that share one pod watch are told apart by matching each pod against each pool's own selector
//! on tongs' side (the API server cannot OR selectors); discovery hands these requirements to
//! kube-core's `Selector`, which has the matcher but no parser of the string form. No crate in the tree
//! parses it, so this one is hand-written, after the grammar of Kubernetes'
//! `k8s.io/apimachinery/pkg/labels` parser for the operators kube-core's `Expression` has (`=`, `==`,
//! `!=`, `in`, `notin`, exists, `!` does-not-exist). `gt` and `lt` are refused by name rather than
//! misread.

use std::collections::BTreeSet;
use std::fmt;

use super::is_qualified_name;

/// One requirement of a label selector; a pod is picked when it meets them all.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Requirement {
    Equal(String, String),
    NotEqual(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A parsed label selector: its requirements in the order written (none: every pod).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LabelSelector(pub Vec<Requirement>);

/// The string form again, as Kubernetes writes it.
impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = |values: &BTreeSet<String>| values.iter().cloned().collect::<Vec<_>>().join(",");
        for (index, requirement) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str(",")?;
            }
            match requirement {
                Requirement::Equal(key, value) => write!(f, "{key}={value}")?,
                Requirement::NotEqual(key, value) => write!(f, "{key}!={value}")?,
                Requirement::In(key, values) => write!(f, "{key} in ({})", set(values))?,
                Requirement::NotIn(key, values) => write!(f, "{key} notin ({})", set(values))?,
                Requirement::Exists(key) => write!(f, "{key}")?,
                Requirement::DoesNotExist(key) => write!(f, "!{key}")?,
            }
        }
        Ok(())
    }
}

/// Parses a label selector; empty text selects every pod. The error says what is wrong and where.
pub fn parse_label_selector(text: &str) -> Result<LabelSelector, String> {
    let mut parser = Parser { rest: text };
    if text.trim().is_empty() {
        return Ok(LabelSelector::default());
    }
    let mut requirements = Vec::new();
    loop {
        requirements.push(parser.requirement()?);
        parser.skip_spaces();
        if parser.rest.is_empty() {
            break;
        }
        if !parser.eat(",") {
            return Err(format!(
                "expected ',' between requirements, found {:?}",
                parser.rest
            ));
        }
    }
    Ok(LabelSelector(requirements))
}

/// A label value: empty, or at most 63 alphanumerics, `-`, `_` and `.`, starting and ending
/// alphanumeric.
pub fn is_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    value.is_empty()
        || (bytes.len() <= 63
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(b))
            && bytes[0].is_ascii_alphanumeric()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric())
}

struct Parser<'a> {
    rest: &'a str,
}

impl Parser<'_> {
    fn skip_spaces(&mut self) {
        self.rest = self.rest.trim_start();
    }

    fn eat(&mut self, token: &str) -> bool {
        match self.rest.strip_prefix(token) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    /// A key, value or operator word: up to whitespace or punctuation.
    fn word(&mut self) -> &str {
        self.skip_spaces();
        let end = self
            .rest
            .find(|c: char| c.is_whitespace() || ",=!()".contains(c))
            .unwrap_or(self.rest.len());
        let (word, rest) = self.rest.split_at(end);
        self.rest = rest;
        word
    }

    fn key(&mut self) -> Result<String, String> {
        let key = self.word();
        if is_qualified_name(key) {
            Ok(key.to_owned())
        } else if key.is_empty() {
            Err(format!("expected a label key, found {:?}", self.rest))
        } else {
            Err(format!(
                "invalid label key {key:?}: an optional DNS prefix and '/', then at most 63 \
                 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
            ))
        }
    }

    fn value(&mut self) -> Result<String, String> {
        let value = self.word();
        if is_label_value(value) {
            Ok(value.to_owned())
        } else {
            Err(format!(
                "invalid label value {value:?}: empty, or at most 63 alphanumerics, '-', '_' or '.', \
                 starting and ending alphanumeric"
            ))
        }
    }

    fn requirement(&mut self) -> Result<Requirement, String> {
        self.skip_spaces();
        if self.eat("!") {
            return Ok(Requirement::DoesNotExist(self.key()?));
        }
        let key = self.key()?;
        self.skip_spaces();
        if self.rest.is_empty() || self.rest.starts_with(',') {
            return Ok(Requirement::Exists(key));
        }
        if self.eat("!=") {
            return Ok(Requirement::NotEqual(key, self.value()?));
        }
        if self.eat("==") || self.eat("=") {
            return Ok(Requirement::Equal(key, self.value()?));
        }
        let operator = self.word().to_owned();
        let values = match operator.as_str() {
            "in" | "notin" => self.set(&key, &operator)?,
            "gt" | "lt" => {
                return Err(format!(
                    "{key}: the {operator} operator is not supported in a label selector here; \
                     use =, ==, !=, in, notin, a key alone or !key"
                ));
            }
            _ => {
                return Err(format!(
                    "{key}: expected =, ==, !=, in, notin, ',' or the end after the key, found {:?}",
                    format!("{operator}{}", self.rest)
                ));
            }
        };
        Ok(if operator == "in" {
            Requirement::In(key, values)
        } else {
            Requirement::NotIn(key, values)
        })
    }

    /// `(a, b, …)` after `in` or `notin`: at least one value.
    fn set(&mut self, key: &str, operator: &str) -> Result<BTreeSet<String>, String> {
        self.skip_spaces();
        if !self.eat("(") {
            return Err(format!(
                "{key} {operator}: expected '(', found {:?}",
                self.rest
            ));
        }
        let mut values = BTreeSet::new();
        loop {
            values.insert(self.value()?);
            self.skip_spaces();
            if self.eat(")") {
                break;
            }
            if !self.eat(",") {
                return Err(format!(
                    "{key} {operator}: expected ',' or ')', found {:?}",
                    self.rest
                ));
            }
        }
        if values.iter().all(String::is_empty) && values.len() == 1 {
            return Err(format!("{key} {operator}: the set of values is empty"));
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn parsed(text: &str) -> Vec<Requirement> {
        parse_label_selector(text)
            .unwrap_or_else(|err| panic!("{text:?}: {err}"))
            .0
    }

    fn set(values: &[&str]) -> BTreeSet<String> {
        values.iter().map(|v| (*v).to_owned()).collect()
    }

    #[test]
    fn every_operator_parses() {
        use Requirement::*;
        assert_eq!(parsed(""), []);
        assert_eq!(parsed("  "), []);
        assert_eq!(parsed("app=llm"), [Equal("app".into(), "llm".into())]);
        assert_eq!(parsed("app==llm"), [Equal("app".into(), "llm".into())]);
        assert_eq!(parsed("app!=llm"), [NotEqual("app".into(), "llm".into())]);
        assert_eq!(parsed("app="), [Equal("app".into(), String::new())]);
        assert_eq!(
            parsed("tier in (a,b)"),
            [In("tier".into(), set(&["a", "b"]))]
        );
        assert_eq!(
            parsed("tier notin ( a , b )"),
            [NotIn("tier".into(), set(&["a", "b"]))]
        );
        assert_eq!(parsed("tongs.dev/pool"), [Exists("tongs.dev/pool".into())]);
        assert_eq!(parsed("!canary"), [DoesNotExist("canary".into())]);
        assert_eq!(
            parsed(" app = llm , ! canary,tier in (x),  gpu "),
            [
                Equal("app".into(), "llm".into()),
                DoesNotExist("canary".into()),
                In("tier".into(), set(&["x"])),
                Exists("gpu".into()),
            ]
        );
    }

    #[test]
    fn broken_selectors_are_refused_in_words() {
        for (text, says) in [
            ("app=llm,", "expected a label key"),
            (",app=llm", "expected a label key"),
            ("app=l m", "expected ','"),
            ("app=-x", "invalid label value"),
            ("-app=x", "invalid label key"),
            ("tier in a,b", "expected '('"),
            ("tier in (a,b", "expected ',' or ')'"),
            ("tier in ()", "the set of values is empty"),
            ("tier notin ()", "the set of values is empty"),
            ("gpu gt 2", "gt operator is not supported"),
            ("app ~ x", "expected =, ==, !=, in, notin"),
            ("app=x)", "expected ','"),
            ("!", "expected a label key"),
        ] {
            let err = parse_label_selector(text).expect_err(text);
            assert!(err.contains(says), "{text:?}: {err}");
        }
    }

    #[test]
    fn what_parses_prints_back_to_the_same_selector() {
        for text in [
            "app=llm",
            "a!=b,c in (x,y),!d,e",
            "tongs.dev/pool notin (p)",
        ] {
            let selector = parse_label_selector(text).unwrap();
            assert_eq!(parse_label_selector(&selector.to_string()), Ok(selector));
        }
    }

    proptest! {
        #[test]
        fn the_parser_never_panics(text in "\\PC{0,40}") {
            let _ = parse_label_selector(&text);
        }

        #[test]
        fn the_parser_never_panics_on_selector_like_text(
            text in "[a-z!=(), ]{0,30}|[a-z./-]{1,8}( ?(=|==|!=) ?[a-z0-9._-]{0,6}| (in|notin) \\([a-z, ]{0,10}\\)?)?"
        ) {
            if let Ok(selector) = parse_label_selector(&text) {
                // Whatever parses prints back to the same selector.
                prop_assert_eq!(parse_label_selector(&selector.to_string()), Ok(selector));
            }
        }
    }
}
