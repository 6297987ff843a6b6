//! Server-Sent Events cut into whole events, byte for byte.
//!
//! A relayed stream is passed on event by event, never a partial one: when a node breaks mid-event,
//! the client has seen only whole events, and a continuation's events follow cleanly. Hand-written
//! because the SSE crates parse into owned field values, while the relay must forward the node's own
//! bytes untouched and only read the `data` lines.

use bytes::{Bytes, BytesMut};

/// Bytes of a stream, cut into events at their blank lines.
#[derive(Debug, Default)]
pub struct Events {
    buffer: BytesMut,
    /// How far `buffer` has been scanned without finding an event's end.
    scanned: usize,
    /// Whether the line before `scanned` was empty (so the next line end closes an event).
    at_line_start: bool,
}

/// Longest event kept while waiting for its end; a node that sends more without a blank line is not
/// speaking SSE, and the relay gives up reading it as events.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

impl Events {
    pub fn new() -> Events {
        Events {
            at_line_start: true,
            ..Events::default()
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.buffer.extend_from_slice(data);
    }

    /// Bytes held of an event not yet complete.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Everything held, complete or not (for a stream given up reading as events).
    pub fn take(&mut self) -> Option<Bytes> {
        self.scanned = 0;
        self.at_line_start = true;
        (!self.buffer.is_empty()).then(|| self.buffer.split().freeze())
    }

    /// Forgets a partial event (its node broke off mid-event).
    pub fn clear(&mut self) {
        self.buffer.clear();
        self.scanned = 0;
        self.at_line_start = true;
    }

    /// The next complete event, with its terminating blank line.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let bytes = &self.buffer[..];
        let mut at = self.scanned;
        while at < bytes.len() {
            let end_len = match bytes[at] {
                b'\n' => 1,
                b'\r' => match bytes.get(at + 1) {
                    Some(b'\n') => 2,
                    Some(_) => 1,
                    // A lone `\r` at the end may be the first half of `\r\n`: wait for more.
                    None => break,
                },
                _ => {
                    self.at_line_start = false;
                    at += 1;
                    continue;
                }
            };
            at += end_len;
            if self.at_line_start {
                let event = self.buffer.split_to(at).freeze();
                self.scanned = 0;
                return Some(event);
            }
            self.at_line_start = true;
        }
        self.scanned = at;
        None
    }
}

/// Whether `chunk` holds nothing but SSE comments and blank lines (a keep-alive such as `: ping`):
/// no progress of the answer, whatever the node's HTTP layer still sends. A chunk that does not start
/// with `:` is taken as progress without a look further (a comment cut across two chunks is then
/// counted once, which errs on the side of a node that lives).
pub fn is_keep_alive(chunk: &[u8]) -> bool {
    chunk.first() == Some(&b':')
        && chunk
            .split(|&byte| byte == b'\n' || byte == b'\r')
            .all(|line| line.is_empty() || line[0] == b':')
}

/// The `data` of an event: its `data:` lines' values joined by `\n` (`None` when it has none, such as
/// a comment or a keep-alive).
pub fn data(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let mut joined: Option<String> = None;
    for line in text.split(['\n', '\r']) {
        let value = if line == "data" {
            ""
        } else if let Some(rest) = line.strip_prefix("data:") {
            rest.strip_prefix(' ').unwrap_or(rest)
        } else {
            continue;
        };
        match &mut joined {
            Some(joined) => {
                joined.push('\n');
                joined.push_str(value);
            }
            None => joined = Some(value.to_owned()),
        }
    }
    joined
}

#[cfg(test)]
mod tests {
    #[test]
    fn keep_alives_are_comments_and_blank_lines_only() {
        assert!(super::is_keep_alive(b": ping\n\n"));
        assert!(super::is_keep_alive(b":\r\n\r\n: again\n\n"));
        assert!(!super::is_keep_alive(b": ping\n\ndata: {}\n\n"));
        assert!(!super::is_keep_alive(b"data: [DONE]\n\n"));
        assert!(!super::is_keep_alive(b""));
    }

    use super::*;

    fn all(events: &mut Events) -> Vec<Bytes> {
        std::iter::from_fn(|| events.next_event()).collect()
    }

    #[test]
    fn events_end_at_blank_lines_whatever_the_line_endings() {
        let mut events = Events::new();
        events.push(b"data: a\n\ndata: b\r\n\r\n: ping\r\rdata: c\n");
        assert_eq!(
            all(&mut events),
            vec![
                Bytes::from_static(b"data: a\n\n"),
                Bytes::from_static(b"data: b\r\n\r\n"),
                Bytes::from_static(b": ping\r\r"),
            ]
        );
        assert_eq!(events.pending(), "data: c\n".len());
        events.push(b"\n");
        assert_eq!(all(&mut events), vec![Bytes::from_static(b"data: c\n\n")]);
        assert_eq!(events.pending(), 0);
    }

    #[test]
    fn an_event_split_anywhere_comes_out_whole() {
        let stream = b"data: {\"x\":1}\r\n\r\nid: 2\ndata: y\ndata: z\n\n";
        for cut in 0..stream.len() {
            let mut events = Events::new();
            events.push(&stream[..cut]);
            let mut got = all(&mut events);
            events.push(&stream[cut..]);
            got.extend(all(&mut events));
            assert_eq!(
                got,
                vec![
                    Bytes::from_static(b"data: {\"x\":1}\r\n\r\n"),
                    Bytes::from_static(b"id: 2\ndata: y\ndata: z\n\n"),
                ],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn data_lines_are_joined_and_other_fields_ignored() {
        assert_eq!(data(b"data: [DONE]\n\n").as_deref(), Some("[DONE]"));
        assert_eq!(data(b"id: 1\ndata:a\ndata: b\n\n").as_deref(), Some("a\nb"));
        assert_eq!(data(b": keep-alive\n\n"), None);
        assert_eq!(data(b"data\n\n").as_deref(), Some(""));
    }
}
