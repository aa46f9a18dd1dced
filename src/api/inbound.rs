//! What a WebSocket connection reads, handed to its frame decoder one whole frame at a time.
//!
//! The decoder (`actix-web-actors`' `WsStream`) takes everything its source has ready into a
//! buffer of its own, with no bound, each time it is asked for a frame, and decodes one frame
//! from it. Only the connection's output held the client back, so a client that wrote frames
//! needing no answer (pongs) as fast as it could grew the daemon's memory at the rate it wrote
//! (the HTTP layer reads 128 KiB from the socket at a time while the decoder takes one 6-byte
//! frame). [`FrameAtATime`] sits between the request's body and the decoder: it gives the
//! decoder one whole frame, then says "not yet" to the decoder's next pull, so the decoder
//! holds at most one frame, this adapter at most one frame and one read, and the HTTP layer
//! stops reading the socket while both are full: the client's writes wait in its own socket.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::Stream;

/// The body of a WebSocket request, frame by frame (see the module).
pub struct FrameAtATime<S> {
    inner: S,
    buf: BytesMut,
    /// A frame was just given: the decoder's next pull, in the same call, is told to wait (it
    /// has a whole frame to decode, and asks again after it).
    just_gave: bool,
    /// The source ended.
    ended: bool,
    /// A frame declaring more than this payload is passed on as it is, at once, for the decoder
    /// to refuse (its limit), not gathered here.
    max_payload: usize,
}

impl<S> FrameAtATime<S> {
    pub fn new(inner: S, max_payload: usize) -> Self {
        FrameAtATime {
            inner,
            buf: BytesMut::new(),
            just_gave: false,
            ended: false,
            max_payload,
        }
    }

    /// The length of the first frame in `buf` if it is whole (or if it declares a payload over
    /// `max_payload`: all that is buffered, for the decoder to refuse); `None` if it is not yet.
    fn first_frame(&self) -> Option<usize> {
        let b = &self.buf;
        if b.len() < 2 {
            return None;
        }
        let masked = b[1] & 0x80 != 0;
        let (header, len) = match b[1] & 0x7f {
            126 => {
                let bytes: [u8; 2] = b.get(2..4)?.try_into().ok()?;
                (4, u64::from(u16::from_be_bytes(bytes)))
            }
            127 => {
                let bytes: [u8; 8] = b.get(2..10)?.try_into().ok()?;
                (10, u64::from_be_bytes(bytes))
            }
            n => (2, u64::from(n)),
        };
        let header = header + if masked { 4 } else { 0 };
        let Ok(len) = usize::try_from(len) else {
            return Some(b.len());
        };
        if len > self.max_payload {
            return Some(b.len());
        }
        let whole = header + len;
        (b.len() >= whole).then_some(whole)
    }
}

impl<S, E> Stream for FrameAtATime<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    type Item = Result<Bytes, E>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.just_gave {
            // The decoder pulls until told to wait, then decodes the whole frame it was given;
            // it pulls again when asked for its next frame.
            this.just_gave = false;
            return Poll::Pending;
        }
        loop {
            if let Some(n) = this.first_frame() {
                this.just_gave = true;
                return Poll::Ready(Some(Ok(this.buf.split_to(n).freeze())));
            }
            if this.ended {
                // What is left is no whole frame: the decoder's to see, then the end.
                if this.buf.is_empty() {
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Ok(this.buf.split().freeze())));
            }
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(bytes))) => this.buf.extend_from_slice(&bytes),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => this.ended = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0x80 | opcode];
        match payload.len() {
            n if n < 126 => out.push(0x80 | n as u8),
            n if n <= 0xffff => {
                out.push(0x80 | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(0x80 | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(&[1, 2, 3, 4]);
        out.extend_from_slice(payload);
        out
    }

    /// A source of these chunks, then its end.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl Stream for Chunks {
        type Item = Result<Bytes, ()>;
        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn poll(s: &mut FrameAtATime<Chunks>) -> Poll<Option<Result<Bytes, ()>>> {
        let mut cx = Context::from_waker(Waker::noop());
        Pin::new(s).poll_next(&mut cx)
    }

    /// One read holding thousands of frames is given one frame per pull, each pull after a
    /// frame told to wait; frames split across reads are given whole; a frame declaring more
    /// than the limit is passed on at once; what is left at the end is passed on.
    #[test]
    fn frames_are_given_one_whole_frame_at_a_time() {
        let pong = frame(0xA, b"");
        let text = frame(0x1, &[b'x'; 300]);
        let many: Vec<u8> = pong
            .iter()
            .copied()
            .cycle()
            .take(pong.len() * 1000)
            .collect();
        let mut joined = text.clone();
        joined.extend_from_slice(&pong);
        let (a, b) = joined.split_at(150);
        let source = Chunks(
            [
                Bytes::from(many),
                Bytes::copy_from_slice(a),
                Bytes::copy_from_slice(b),
            ]
            .into(),
        );
        let mut s = FrameAtATime::new(source, 1024);
        for _ in 0..1000 {
            assert_eq!(
                poll(&mut s),
                Poll::Ready(Some(Ok(Bytes::from(pong.clone()))))
            );
            assert_eq!(poll(&mut s), Poll::Pending);
            assert!(s.buf.len() <= pong.len() * 1000);
        }
        assert_eq!(poll(&mut s), Poll::Ready(Some(Ok(Bytes::from(text)))));
        assert_eq!(poll(&mut s), Poll::Pending);
        assert_eq!(poll(&mut s), Poll::Ready(Some(Ok(Bytes::from(pong)))));
        assert_eq!(poll(&mut s), Poll::Pending);
        assert_eq!(poll(&mut s), Poll::Ready(None));

        let mut big = frame(0x1, &[b'y'; 2000]);
        big.truncate(100);
        let mut s = FrameAtATime::new(Chunks([Bytes::from(big.clone())].into()), 1024);
        assert_eq!(poll(&mut s), Poll::Ready(Some(Ok(Bytes::from(big)))));

        let half = &frame(0x1, b"abc")[..5];
        let mut s = FrameAtATime::new(Chunks([Bytes::copy_from_slice(half)].into()), 1024);
        assert_eq!(
            poll(&mut s),
            Poll::Ready(Some(Ok(Bytes::copy_from_slice(half))))
        );
        assert_eq!(poll(&mut s), Poll::Ready(None));
    }
}
