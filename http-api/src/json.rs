//! Writing the bulk-get answer and the PUT answer straight into a buffer.
//!
//! A 16-key bulk get is mostly JSON encoding; building `KeyResult`s (a copy of every value
//! into a `String`) and letting serde escape them byte by byte cost more than the lookups.
//! A PUT's small answer through serde and axum's `Json` cost about 1,000 instructions, a
//! twentieth of the whole request.
//! Strings without characters JSON must escape (the common case: printable text) are copied
//! as they are; the others go through serde_json.

use crate::types::{GetOk, KeyResult, PutOk};

/// Appends `s` as a JSON string.
pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) {
    // No early exit: a plain fold over the bytes vectorizes, and most strings need no escape.
    let escape = s.as_bytes().iter().fold(false, |acc, &b| acc | (b < 0x20) | (b == b'"') | (b == b'\\'));
    if !escape {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

fn write_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// Appends the result of a key that was found: the same fields, in the same order, as
/// serializing a [`KeyResult`] would give.
pub(crate) fn write_found(out: &mut Vec<u8>, key: &str, ok: &GetOk) {
    out.extend_from_slice(b"{\"key\":");
    write_str(out, key);
    out.extend_from_slice(b",\"found\":true,");
    match std::str::from_utf8(&ok.value) {
        Ok(text) => {
            out.extend_from_slice(b"\"value\":");
            write_str(out, text);
        }
        Err(_) => {
            use base64::Engine;
            out.extend_from_slice(b"\"value_base64\":\"");
            out.extend_from_slice(base64::engine::general_purpose::STANDARD.encode(&ok.value).as_bytes());
            out.push(b'"');
        }
    }
    out.extend_from_slice(b",\"version\":");
    write_u64(out, ok.version);
    out.extend_from_slice(b",\"bucket\":");
    write_u64(out, u64::from(ok.bucket));
    out.push(b'}');
}

/// Appends a PUT's answer: the same fields, in the same order, as serializing [`PutOk`] would
/// give.
pub(crate) fn write_put_ok(out: &mut Vec<u8>, ok: &PutOk) {
    out.extend_from_slice(b"{\"key\":");
    write_str(out, &ok.key);
    out.extend_from_slice(b",\"version\":");
    write_u64(out, ok.version);
    out.extend_from_slice(b",\"bucket\":");
    write_u64(out, u64::from(ok.bucket));
    out.extend_from_slice(b",\"node\":");
    write_u64(out, ok.node);
    out.push(b'}');
}

/// Appends any other result through serde.
pub(crate) fn write_result(out: &mut Vec<u8>, result: &KeyResult) {
    let _ = serde_json::to_writer(&mut *out, result);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_results_equal_serde_results() {
        for (key, value) in [
            ("plain", &b"hello"[..]),
            ("quote\"key", b"line\nbreak \"q\" \\"),
            ("ünï", "välue".as_bytes()),
            ("bin", &[0xff, 0x00, 0x80][..]),
        ] {
            let ok =
                GetOk { value: bytes::Bytes::copy_from_slice(value), version: 42, bucket: 7, node: 1, lag_ms: None };
            let mut fast = Vec::new();
            write_found(&mut fast, key, &ok);
            let (text, b64) = match std::str::from_utf8(value) {
                Ok(t) => (Some(t.to_string()), None),
                Err(_) => {
                    use base64::Engine;
                    (None, Some(base64::engine::general_purpose::STANDARD.encode(value)))
                }
            };
            let reference = KeyResult {
                key: key.into(),
                found: Some(true),
                value: text,
                value_base64: b64,
                version: Some(42),
                bucket: 7,
                ..Default::default()
            };
            assert_eq!(String::from_utf8(fast).expect("utf8"), serde_json::to_string(&reference).expect("json"));
        }
    }

    #[test]
    fn the_fast_put_answer_equals_serde_s() {
        for key in ["plain", "quote\"key", "ünï", "tab\tand\u{1}control", ""] {
            let ok = PutOk { key: key.into(), version: u64::MAX, bucket: 999, node: 12 };
            let mut fast = Vec::new();
            write_put_ok(&mut fast, &ok);
            assert_eq!(String::from_utf8(fast).expect("utf8"), serde_json::to_string(&ok).expect("json"));
        }
    }
}
