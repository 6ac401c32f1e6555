//! A command connection driven by its callers' own tasks, for one plain-TCP Redis server.
//!
//! redis-rs's multiplexed connection hands every command to a driver task and its reply
//! back: two cross-thread hand-offs per round trip. Here the caller's task writes its
//! command to the socket itself and reads replies itself: the task that finds the socket
//! readable parses what arrived and hands each reply to the request it answers, in the
//! order the commands were written (one TCP stream, one order, as on the multiplexed
//! connection: a command sent after another runs after it on the server, which the
//! give-backs of abandoned acquisitions rely on).
//!
//! # Cancel safety
//! A request is queued (its bytes appended to the line's output, in order) at its first
//! poll, and from then on it is part of the stream: dropping its future abandons only the
//! reply, which is read and discarded in turn. A dropped request wakes another waiter, so
//! the socket's readiness is always watched by someone while a reply is awaited.
//!
//! The line is replaced when it breaks (an I/O error, the server closing it, a reply that
//! does not parse): requests in flight fail with a connection error, and the next request
//! opens a new line. Commands that were queued on a broken line are never sent again.

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    io,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll, Waker},
    time::Duration,
};

use redis::{
    Cmd, ConnectionAddr, ErrorKind, Pipeline, ProtocolVersion, RedisError, RedisFuture,
    RedisResult, Value, aio::ConnectionLike,
};
use tokio::net::TcpStream;

/// Whether `client` can be served by a [`DirectConn`]: plain TCP and RESP2 (TLS, Unix
/// sockets and RESP3 stay on redis-rs's own connection).
pub(crate) fn supports(client: &redis::Client) -> bool {
    let info = client.get_connection_info();
    matches!(info.addr(), ConnectionAddr::Tcp(..))
        && info.redis_settings().protocol() == ProtocolVersion::RESP2
}

/// A reconnecting command connection to one server, driven by the tasks that use it.
#[derive(Clone)]
pub struct DirectConn {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DirectConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectConn")
            .field("host", &self.shared.host)
            .field("port", &self.shared.port)
            .finish_non_exhaustive()
    }
}

struct Shared {
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    connect_timeout: Duration,
    response_timeout: Duration,
    /// The line in use; `None` or broken: the next request opens another.
    line: Mutex<Option<Arc<Line>>>,
    /// One opening at a time.
    opening: tokio::sync::Mutex<()>,
}

/// One TCP connection and what is in flight on it.
struct Line {
    stream: TcpStream,
    state: Mutex<LineState>,
}

#[derive(Default)]
struct LineState {
    /// Bytes queued and not yet written, from `written` on.
    out: Vec<u8>,
    written: usize,
    /// Bytes read and not yet parsed.
    input: Vec<u8>,
    next_id: u64,
    /// Requests that still expect replies, in the order their commands were queued.
    queue: VecDeque<u64>,
    requests: HashMap<u64, Request>,
    broken: Option<(io::ErrorKind, String)>,
}

struct Request {
    expected: usize,
    replies: Vec<Value>,
    waker: Option<Waker>,
    /// Its caller went away: its replies are read and dropped.
    abandoned: bool,
}

impl LineState {
    fn request(&self, id: u64) -> Option<&Request> {
        self.requests.get(&id)
    }

    /// Wakes the first request still waiting, other than `except`, so that someone
    /// watches the socket.
    fn wake_a_watcher(&self, except: u64) {
        if let Some(waker) = self
            .queue
            .iter()
            .filter(|id| **id != except)
            .find_map(|id| self.requests.get(id).and_then(|r| r.waker.as_ref()))
        {
            waker.wake_by_ref();
        }
    }

    fn break_with(&mut self, kind: io::ErrorKind, message: String) {
        if self.broken.is_none() {
            self.broken = Some((kind, message));
        }
        for request in self.requests.values_mut() {
            if let Some(waker) = request.waker.take() {
                waker.wake();
            }
        }
    }

    /// Hands each complete reply in `input` to the request it answers.
    fn dispatch(&mut self) {
        loop {
            let Some(&front) = self.queue.front() else {
                if !self.input.is_empty() {
                    self.break_with(
                        io::ErrorKind::InvalidData,
                        "the server sent a reply nobody asked for".into(),
                    );
                }
                return;
            };
            let len = match frame_len(&self.input, 0) {
                Ok(Some(len)) => len,
                Ok(None) => return,
                Err(message) => {
                    self.break_with(io::ErrorKind::InvalidData, message);
                    return;
                }
            };
            let value = match redis::parse_redis_value(&self.input[..len]) {
                Ok(value) => value,
                Err(e) => {
                    self.break_with(io::ErrorKind::InvalidData, e.to_string());
                    return;
                }
            };
            self.input.drain(..len);
            let Some(request) = self.requests.get_mut(&front) else {
                self.queue.pop_front();
                continue;
            };
            request.replies.push(value);
            if request.replies.len() >= request.expected {
                self.queue.pop_front();
                if request.abandoned {
                    self.requests.remove(&front);
                } else if let Some(waker) = request.waker.take() {
                    waker.wake();
                }
            }
        }
    }
}

/// The length of the RESP2 reply at `at` in `buf`: `None` while incomplete.
fn frame_len(buf: &[u8], at: usize) -> Result<Option<usize>, String> {
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some(line_end) = buf[at..].windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let after_line = at + line_end + 2;
    let number = || -> Result<i64, String> {
        std::str::from_utf8(&buf[at + 1..at + line_end])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| "a reply length that is not a number".to_owned())
    };
    match kind {
        b'+' | b'-' | b':' => Ok(Some(after_line - at)),
        b'$' => {
            let n = number()?;
            if n < 0 {
                return Ok(Some(after_line - at));
            }
            let end = after_line + usize::try_from(n).map_err(|e| e.to_string())? + 2;
            Ok((end <= buf.len()).then_some(end - at))
        }
        b'*' => {
            let n = number()?;
            let mut end = after_line;
            for _ in 0..n.max(0) {
                match frame_len(buf, end)? {
                    Some(len) => end += len,
                    None => return Ok(None),
                }
            }
            Ok(Some(end - at))
        }
        other => Err(format!(
            "an unexpected reply type {:?} (RESP2 expected)",
            char::from(other)
        )),
    }
}

fn lock(state: &Mutex<LineState>) -> MutexGuard<'_, LineState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A queued request's wait for its replies.
struct Replies {
    line: Arc<Line>,
    id: u64,
    done: bool,
}

impl Future for Replies {
    type Output = io::Result<Vec<Value>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let line = &this.line;
        let mut state = lock(&line.state);
        loop {
            if state
                .request(this.id)
                .is_some_and(|r| r.replies.len() >= r.expected)
            {
                let replies = state
                    .requests
                    .remove(&this.id)
                    .map(|r| r.replies)
                    .unwrap_or_default();
                this.done = true;
                state.wake_a_watcher(this.id);
                return Poll::Ready(Ok(replies));
            }
            if let Some((kind, message)) = &state.broken {
                let error = io::Error::new(*kind, message.clone());
                state.requests.remove(&this.id);
                this.done = true;
                return Poll::Ready(Err(error));
            }
            let mut progress = false;
            if state.written < state.out.len() {
                match line.stream.poll_write_ready(cx) {
                    Poll::Ready(Ok(())) => {
                        let written = state.written;
                        match line.stream.try_write(&state.out[written..]) {
                            Ok(n) => {
                                state.written += n;
                                if state.written == state.out.len() {
                                    state.out.clear();
                                    state.written = 0;
                                }
                                progress = true;
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => progress = true,
                            Err(e) => state.break_with(e.kind(), e.to_string()),
                        }
                    }
                    Poll::Ready(Err(e)) => state.break_with(e.kind(), e.to_string()),
                    Poll::Pending => {}
                }
                if state.broken.is_some() {
                    continue;
                }
            }
            match line.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {
                    state.input.reserve(4096);
                    match line.stream.try_read_buf(&mut state.input) {
                        Ok(0) => state.break_with(
                            io::ErrorKind::UnexpectedEof,
                            "the server closed the connection".into(),
                        ),
                        Ok(_) => state.dispatch(),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => state.break_with(e.kind(), e.to_string()),
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    state.break_with(e.kind(), e.to_string());
                    continue;
                }
                Poll::Pending => {}
            }
            if progress {
                continue;
            }
            if let Some(request) = state.requests.get_mut(&this.id) {
                request.waker = Some(cx.waker().clone());
            }
            return Poll::Pending;
        }
    }
}

impl Drop for Replies {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = lock(&self.line.state);
        let complete = match state.requests.get_mut(&self.id) {
            Some(request) if request.replies.len() >= request.expected => true,
            Some(request) => {
                request.abandoned = true;
                request.waker = None;
                false
            }
            None => false,
        };
        if complete {
            state.requests.remove(&self.id);
        }
        // This task may have been the one the socket's readiness would wake.
        state.wake_a_watcher(self.id);
    }
}

impl Line {
    /// Queues `bytes` (answered by `expected` replies) and tries to write them at once.
    fn submit(self: &Arc<Self>, bytes: &[u8], expected: usize) -> io::Result<Replies> {
        let mut state = lock(&self.state);
        if let Some((kind, message)) = &state.broken {
            return Err(io::Error::new(*kind, message.clone()));
        }
        let id = state.next_id;
        state.next_id += 1;
        state.queue.push_back(id);
        state.requests.insert(
            id,
            Request {
                expected,
                replies: Vec::with_capacity(expected),
                waker: None,
                abandoned: false,
            },
        );
        if state.out.is_empty() {
            match self.stream.try_write(bytes) {
                Ok(n) => {
                    if n < bytes.len() {
                        state.out.extend_from_slice(&bytes[n..]);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    state.out.extend_from_slice(bytes);
                }
                Err(e) => state.break_with(e.kind(), e.to_string()),
            }
        } else {
            state.out.extend_from_slice(bytes);
        }
        Ok(Replies {
            line: self.clone(),
            id,
            done: false,
        })
    }

    /// Whether the line is known to be unusable: broken, or (with nothing in flight) the
    /// server closed it or sent something unasked (seen without blocking).
    fn is_broken(&self) -> bool {
        let mut state = lock(&self.state);
        if state.broken.is_some() {
            return true;
        }
        if state.queue.is_empty() && state.input.is_empty() {
            let mut probe = [0u8; 1];
            match self.stream.try_read(&mut probe) {
                Ok(0) => state.break_with(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection".into(),
                ),
                Ok(_) => state.break_with(
                    io::ErrorKind::InvalidData,
                    "the server sent a reply nobody asked for".into(),
                ),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => state.break_with(e.kind(), e.to_string()),
            }
        }
        state.broken.is_some()
    }
}

fn timed_out(what: &str, after: Duration) -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} got no answer within {after:?}"),
    ))
}

impl DirectConn {
    /// Connects to `client`'s server (see [`supports`]), within `connect_timeout`; every
    /// request then waits at most `response_timeout` for its replies.
    ///
    /// # Errors
    /// When the server cannot be reached or refuses the credentials.
    pub async fn connect(
        client: &redis::Client,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        let info = client.get_connection_info();
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a direct connection needs a plain TCP address",
            )));
        };
        let settings = info.redis_settings();
        let conn = DirectConn {
            shared: Arc::new(Shared {
                host: host.clone(),
                port: *port,
                username: settings.username().map(str::to_owned),
                password: settings.password().map(str::to_owned),
                db: settings.db(),
                connect_timeout,
                response_timeout,
                line: Mutex::new(None),
                opening: tokio::sync::Mutex::new(()),
            }),
        };
        conn.line().await?;
        Ok(conn)
    }

    /// The line in use, opening one if there is none or it broke.
    async fn line(&self) -> RedisResult<Arc<Line>> {
        if let Some(line) = self.current() {
            return Ok(line);
        }
        let _opening = self.shared.opening.lock().await;
        if let Some(line) = self.current() {
            return Ok(line);
        }
        let timeout = self.shared.connect_timeout;
        let line = tokio::time::timeout(timeout, self.open())
            .await
            .map_err(|_| timed_out("connecting", timeout))??;
        *self
            .shared
            .line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(line.clone());
        Ok(line)
    }

    fn current(&self) -> Option<Arc<Line>> {
        let line = self
            .shared
            .line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()?;
        (!line.is_broken()).then_some(line)
    }

    /// A new line, authenticated and on the configured database.
    async fn open(&self) -> RedisResult<Arc<Line>> {
        let shared = &self.shared;
        let stream = TcpStream::connect((shared.host.as_str(), shared.port)).await?;
        stream.set_nodelay(true)?;
        let line = Arc::new(Line {
            stream,
            state: Mutex::new(LineState::default()),
        });
        if let Some(password) = &shared.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(username) = &shared.username {
                auth.arg(username);
            }
            auth.arg(password);
            one(line.submit(&auth.get_packed_command(), 1)?.await?)?.extract_error()?;
        }
        if shared.db != 0 {
            let select = redis::cmd("SELECT").arg(shared.db).get_packed_command();
            one(line.submit(&select, 1)?.await?)?.extract_error()?;
        }
        Ok(line)
    }

    /// Sends `bytes`, answered by `expected` replies, and waits for them.
    async fn exchange(&self, bytes: Vec<u8>, expected: usize) -> RedisResult<Vec<Value>> {
        let line = self.line().await?;
        let replies = line.submit(&bytes, expected)?;
        let timeout = self.shared.response_timeout;
        Ok(tokio::time::timeout(timeout, replies)
            .await
            .map_err(|_| timed_out("a request", timeout))??)
    }
}

fn one(mut replies: Vec<Value>) -> RedisResult<Value> {
    replies
        .pop()
        .ok_or_else(|| RedisError::from((ErrorKind::Parse, "a request was answered by no reply")))
}

impl ConnectionLike for DirectConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let replies = self.exchange(cmd.get_packed_command(), 1).await?;
            one(replies)?.extract_error()
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut replies = self
                .exchange(pipeline.get_packed_pipeline(), offset + count)
                .await?;
            let values: Vec<Value> = replies.drain(offset..).collect();
            // As redis-rs's connections do: a server error in any of them fails the call.
            values.into_iter().map(Value::extract_error).collect()
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}

#[cfg(test)]
mod tests {
    use super::frame_len;

    #[test]
    fn frame_lengths_follow_resp2() {
        assert_eq!(frame_len(b"+OK\r\n", 0), Ok(Some(5)));
        assert_eq!(frame_len(b"+OK\r", 0), Ok(None));
        assert_eq!(frame_len(b":12\r\n:1", 0), Ok(Some(5)));
        assert_eq!(frame_len(b"$3\r\nabc\r\n", 0), Ok(Some(9)));
        assert_eq!(frame_len(b"$3\r\nabc\r", 0), Ok(None));
        assert_eq!(frame_len(b"$-1\r\n", 0), Ok(Some(5)));
        assert_eq!(frame_len(b"*2\r\n:1\r\n$1\r\nx\r\n", 0), Ok(Some(15)));
        assert_eq!(frame_len(b"*2\r\n:1\r\n$1\r\nx", 0), Ok(None));
        assert_eq!(frame_len(b"*-1\r\n", 0), Ok(Some(5)));
        assert_eq!(frame_len(b"*1\r\n*1\r\n-ERR x\r\n", 0), Ok(Some(16)));
        assert!(frame_len(b"%1\r\n", 0).is_err());
        assert!(frame_len(b"$x\r\n", 0).is_err());
    }
}
