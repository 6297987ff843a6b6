//! Header names the configuration gives: checked when the file is read, kept as `http::HeaderName`.

use serde::{Deserialize, Serialize};

/// A header name from the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header(pub http::HeaderName);

impl Header {
    pub const fn from_static(name: &'static str) -> Header {
        Header(http::HeaderName::from_static(name))
    }

    pub fn name(&self) -> &http::HeaderName {
        &self.0
    }
}

impl Serialize for Header {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0.as_str())
    }
}

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        http::HeaderName::from_bytes(text.as_bytes())
            .map(Header)
            .map_err(|_| serde::de::Error::custom(format!("{text:?} is not a valid header name")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_names_are_checked_when_read() {
        let read: Header = serde_json::from_str("\"X-Priority\"").unwrap();
        assert_eq!(read.name(), "x-priority");
        let bad = serde_json::from_str::<Header>("\"bad header\"").unwrap_err();
        assert!(bad.to_string().contains("not a valid header name"), "{bad}");
        assert_eq!(serde_json::to_string(&read).unwrap(), "\"x-priority\"");
    }
}
