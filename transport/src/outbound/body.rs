//! Bounds on what the router reads from workers: [`read_capped`], and the kinds of answer
//! with their caps and the counter of refusals ([`BodyKind`], [`Refusals`]: defined in
//! [`crate::worker_answers`], which the error type and the metrics share, re-exported here).
//!
//! # Invariants
//! 1. An answer the router buffers is read through [`read_capped`]: at most
//!    [`BodyKind::cap`] bytes are ever held (a `Content-Length` over the cap is refused
//!    before any byte is read); one byte more ends the read and drops the connection.
//! 2. Every refusal is counted and logged ([`crate::worker_answers`], invariant 2).

use bytes::Bytes;
use http_body_util::BodyExt;

pub use crate::worker_answers::{BodyKind, MAX_HELD_ANSWER, Overrun, Refusals};

/// Why [`read_capped`] gave no body.
#[derive(Debug)]
pub enum ReadError {
    /// Over the cap.
    TooLarge,
    /// The body broke off (connection reset, a malformed chunk).
    Broken(String),
}

/// Reads `body` whole, holding at most `cap` bytes (invariant 1). The caller bounds the
/// time.
pub async fn read_capped<B>(body: B, cap: usize) -> Result<Bytes, ReadError>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match http_body_util::Limited::new(body, cap).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ReadError::TooLarge),
        Err(e) => Err(ReadError::Broken(crate::error::chain(&*e))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};
    use hyper::body::Frame;

    #[tokio::test]
    async fn bodies_over_the_cap_are_refused_whatever_their_length_says() {
        let ok = read_capped(Full::new(Bytes::from_static(b"12345")), 5).await;
        assert_eq!(ok.unwrap(), Bytes::from_static(b"12345"));
        let over = read_capped(Full::new(Bytes::from_static(b"123456")), 5).await;
        assert!(matches!(over, Err(ReadError::TooLarge)));
        // No length announced: chunks counted as they come.
        let chunks = (0..10).map(|_| Ok::<_, std::io::Error>(Frame::data(Bytes::from(vec![0; 3]))));
        let stream = StreamBody::new(futures_util::stream::iter(chunks));
        assert!(matches!(
            read_capped(stream, 20).await,
            Err(ReadError::TooLarge)
        ));
    }
}
