//! A command connection driven by its callers' own tasks, for one plain-TCP Redis server.
//!
//! redis-rs's multiplexed connection hands every command to a driver task and its reply
//! back: two cross-thread hand-offs per round trip. Here the caller's task writes its
//! command to the socket itself, and a request alone on the line reads its reply itself;
//! whoever reads parses what arrived and hands each reply to the request it answers,
//! in the order the commands were written (one TCP stream, one order, as on the
//! multiplexed connection: a command sent after another runs after it on the server, which
//! the give-backs of abandoned acquisitions rely on).
//!
//! # Cancel safety
//! A request is queued (its bytes written, or appended to the line's output, in order) at
//! its first poll, and from then on it is part of the stream: dropping its future abandons
//! only the reply, which is read and discarded in turn. A request whose caller stops
//! polling it (without dropping it) holds up nobody else: a request sent while others wait
//! has a reader task read for it (one per line, while requests wait), and watches the
//! socket itself whenever none runs.
//!
//! The line is replaced when it breaks (an I/O error, the server closing it, a reply that
//! does not parse, the runtime that opened it gone): replies that arrived before the break
//! still reach their requests, the other requests in flight fail with a connection error,
//! and the next request opens a new line, in a task of its own shared by every caller that
//! needs it (a caller that gives up does not stop it). Commands that were queued on a
//! broken line are never sent again.
//!
//! # Runtimes
//! Lines are opened, and their reader tasks run, on the runtime the connection was made on
//! (its *home*), never on a caller's: a caller's runtime may end, or stop being driven (a
//! `current_thread` runtime kept for `block_on`), while the line is in use. If home has
//! ended, a runtime of this module's own, on one thread, becomes home. A reader task
//! dropped before it ran still says that no reader runs; an opening that stalls (home no
//! longer driven) is replaced after the connect timeout, on the spare runtime, and hands
//! its callers no line (two lines at once could run commands out of order).

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    io,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll, Waker},
    time::Duration,
};

use futures_util::{FutureExt, future::Shared as SharedFuture};
use redis::{
    Cmd, ConnectionAddr, ErrorKind, Pipeline, ProtocolVersion, RedisError, RedisFuture,
    RedisResult, Value, aio::ConnectionLike,
};
use tokio::{net::TcpStream, sync::Notify};

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

/// Why a line failed, kept to tell every request that was on it (cloneable, unlike
/// `io::Error`).
#[derive(Clone, Debug)]
struct Failure {
    kind: io::ErrorKind,
    message: String,
    /// The server refused the connection's set-up (credentials, database): not an I/O
    /// error, and nothing a retry would change.
    refused: Option<ErrorKind>,
}

impl Failure {
    fn of(error: &io::Error) -> Self {
        Failure {
            kind: error.kind(),
            message: error.to_string(),
            refused: None,
        }
    }

    fn new(kind: io::ErrorKind, message: impl Into<String>) -> Self {
        Failure {
            kind,
            message: message.into(),
            refused: None,
        }
    }

    fn io(&self) -> io::Error {
        io::Error::new(self.kind, self.message.clone())
    }

    fn redis(&self) -> RedisError {
        match self.refused {
            Some(kind) => RedisError::from((kind, "refused by the server", self.message.clone())),
            None => RedisError::from(self.io()),
        }
    }
}

type Opening = SharedFuture<Pin<Box<dyn Future<Output = Result<Arc<Line>, Failure>> + Send>>>;

/// The line in use, or the opening of the next one (when it started, and its number: only
/// the opening in the slot puts its outcome there).
enum Slot {
    Empty,
    Ready(Arc<Line>),
    Opening(Opening, std::time::Instant, u64),
}

struct Shared {
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    connect_timeout: Duration,
    response_timeout: Duration,
    /// The client's TCP settings (see `conn::tcp`), for every line.
    tcp: redis::io::tcp::TcpSettings,
    slot: Mutex<Slot>,
    /// The runtime lines are opened on and their reader tasks run on: the one the
    /// connection was made on, while it runs (else the caller's, from then on). Not a
    /// caller's: a caller's runtime may end, or stop being driven, with the line in use.
    home: Mutex<Option<tokio::runtime::Handle>>,
    /// The number of the next opening.
    next_opening: std::sync::atomic::AtomicU64,
}

/// One TCP connection and what is in flight on it.
struct Line {
    stream: TcpStream,
    state: Mutex<LineState>,
    /// The runtime whose I/O driver the stream is registered with: its reader runs there.
    runtime: Option<tokio::runtime::Handle>,
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
    broken: Option<Failure>,
    /// A [`read_for_waiters`] task runs for this line.
    reader: bool,
    /// When the server last sent anything on the line (or the line opened).
    heard_at: Option<std::time::Instant>,
    /// When `DirectConn::give_up_if_silent` last asked the kernel about the line.
    silence_checked_at: Option<std::time::Instant>,
}

struct Request {
    expected: usize,
    replies: Vec<Value>,
    /// Told when the replies are all there or the line broke.
    done: Arc<Notify>,
    /// Its caller went away: its replies are read and dropped.
    abandoned: bool,
}

impl Request {
    fn complete(&self) -> bool {
        self.replies.len() >= self.expected
    }
}

impl LineState {
    fn break_with(&mut self, failure: Failure) {
        if self.broken.is_none() {
            self.broken = Some(failure);
        }
        for request in self.requests.values() {
            request.done.notify_one();
        }
    }

    fn break_io(&mut self, error: &io::Error) {
        self.break_with(Failure::of(error));
    }

    /// Writes what it can of the output and reads what has arrived (both without
    /// blocking), then hands out the complete replies.
    ///
    /// Replies that arrived before the line failed (the server's close, a reset, a failed
    /// write) are handed out first: a grant the server made and then closed the
    /// connection on is still a grant.
    fn pump(&mut self, stream: &TcpStream) {
        let mut failure = None;
        while self.broken.is_none() && self.written < self.out.len() {
            match stream.try_write(&self.out[self.written..]) {
                Ok(n) => self.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    failure = Some(Failure::of(&e));
                    break;
                }
            }
        }
        if self.written == self.out.len() {
            self.out.clear();
            self.written = 0;
        } else if self.written >= 64 * 1024 {
            self.out.drain(..self.written);
            self.written = 0;
        }
        while self.broken.is_none() {
            self.input.reserve(4096);
            match stream.try_read_buf(&mut self.input) {
                Ok(0) => {
                    failure.get_or_insert_with(closed);
                    break;
                }
                Ok(_) => self.heard_at = Some(std::time::Instant::now()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    failure.get_or_insert_with(|| Failure::of(&e));
                    break;
                }
            }
        }
        if self.broken.is_none() {
            self.dispatch();
        }
        if let Some(failure) = failure {
            self.break_with(failure);
        }
    }

    /// Hands each complete reply in `input` to the request it answers.
    fn dispatch(&mut self) {
        let mut at = 0;
        while at < self.input.len() {
            let Some(&front) = self.queue.front() else {
                self.break_with(unasked());
                return;
            };
            let len = match frame_len(&self.input, at) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(message) => {
                    self.break_with(Failure::new(io::ErrorKind::InvalidData, message));
                    return;
                }
            };
            let value = match redis::parse_redis_value(&self.input[at..at + len]) {
                Ok(value) => value,
                Err(e) => {
                    self.break_with(Failure::new(io::ErrorKind::InvalidData, e.to_string()));
                    return;
                }
            };
            at += len;
            let Some(request) = self.requests.get_mut(&front) else {
                // Cannot happen: a request leaves the map only once complete (and out of
                // the queue), or when the line broke. Refuse to guess.
                self.break_with(unasked());
                return;
            };
            request.replies.push(value);
            if request.complete() {
                self.queue.pop_front();
                if request.abandoned {
                    self.requests.remove(&front);
                } else {
                    request.done.notify_one();
                }
            }
        }
        self.input.drain(..at);
    }

    /// Takes request `id`'s replies if they are all there, or the line's failure.
    fn take(&mut self, id: u64) -> Option<io::Result<Vec<Value>>> {
        if self.requests.get(&id).is_some_and(Request::complete) {
            return self.requests.remove(&id).map(|r| Ok(r.replies));
        }
        let failure = self.broken.as_ref()?.io();
        self.requests.remove(&id);
        Some(Err(failure))
    }
}

fn closed() -> Failure {
    Failure::new(
        io::ErrorKind::UnexpectedEof,
        "the server closed the connection",
    )
}

fn unasked() -> Failure {
    Failure::new(
        io::ErrorKind::InvalidData,
        "the server sent a reply nobody asked for",
    )
}

/// How deeply arrays may nest in a reply. Lock replies nest two deep; the bound keeps a
/// malformed or hostile reply from exhausting the stack (in [`frame_len`] and in the
/// parser after it).
const MAX_REPLY_DEPTH: usize = 32;

/// The length of the RESP2 reply at `at` in `buf`: `None` while incomplete; an error for a
/// malformed reply or one that nests arrays more than [`MAX_REPLY_DEPTH`] deep.
fn frame_len(buf: &[u8], at: usize) -> Result<Option<usize>, String> {
    frame_len_within(buf, at, MAX_REPLY_DEPTH)
}

fn frame_len_within(buf: &[u8], at: usize, depth: usize) -> Result<Option<usize>, String> {
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
            if n > 0 && depth == 0 {
                return Err(format!(
                    "a reply that nests arrays more than {MAX_REPLY_DEPTH} deep"
                ));
            }
            let mut end = after_line;
            for _ in 0..n.max(0) {
                match frame_len_within(buf, end, depth - 1)? {
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Marks a request abandoned if its wait ends before its replies were taken.
struct AbandonOnDrop<'a> {
    line: &'a Line,
    id: u64,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.line.state);
        let complete = match state.requests.get_mut(&self.id) {
            Some(request) if request.complete() => true,
            Some(request) => {
                request.abandoned = true;
                false
            }
            None => false,
        };
        if complete {
            state.requests.remove(&self.id);
        }
    }
}

impl Line {
    /// Whether the line can take a request: not broken, its runtime still there, and (with
    /// nothing in flight) not closed by the server nor sent anything unasked.
    fn usable(&self) -> bool {
        self.check(true)
    }

    /// [`usable`](Self::usable), without the probe for a close or an unasked reply when
    /// `probe` is false (a line just opened: what the server said on it, such as "max
    /// number of clients reached", is the first request's answer).
    fn check(&self, probe: bool) -> bool {
        let mut state = lock(&self.state);
        if state.broken.is_some() {
            return false;
        }
        // Registers a no-op waker in the slot nobody else uses here (waiters use
        // `readable()`): this only asks whether the runtime's I/O driver is still there.
        let mut noop = Context::from_waker(Waker::noop());
        let readiness = self.stream.poll_read_ready(&mut noop);
        if let Poll::Ready(Err(e)) = readiness {
            state.break_io(&e);
            return false;
        }
        if probe && state.queue.is_empty() && state.input.is_empty() && readiness.is_ready() {
            let mut probe = [0u8; 1];
            match self.stream.try_read(&mut probe) {
                Ok(0) => state.break_with(closed()),
                Ok(_) => state.break_with(unasked()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => state.break_io(&e),
            }
        }
        state.broken.is_none()
    }

    /// Queues `bytes` (answered by `expected` replies, at least one), writes what it can
    /// at once, and waits for the replies.
    ///
    /// A request alone on the line watches the socket itself: no task switch on the way.
    /// One sent while others wait leaves the reading to one reader task for the line (see
    /// [`read_for_waiters`]), so that 32 concurrent requests are not 32 tasks woken by
    /// every reply; it watches the socket itself again whenever no reader runs.
    async fn exchange(self: &Arc<Self>, bytes: &[u8], expected: usize) -> io::Result<Vec<Value>> {
        let (id, done, first, reader) = {
            let mut state = lock(&self.state);
            if let Some(failure) = &state.broken {
                return Err(failure.io());
            }
            let first = state.queue.is_empty();
            let reader = (!first && !state.reader)
                .then(|| self.runtime.clone())
                .flatten();
            state.reader |= reader.is_some();
            let id = state.next_id;
            state.next_id += 1;
            let done = Arc::new(Notify::new());
            state.queue.push_back(id);
            state.requests.insert(
                id,
                Request {
                    expected,
                    replies: Vec::with_capacity(expected),
                    done: done.clone(),
                    abandoned: false,
                },
            );
            state.out.extend_from_slice(bytes);
            state.pump(&self.stream);
            (id, done, first, reader)
        };
        let _abandon = AbandonOnDrop { line: self, id };
        if let Some(runtime) = reader {
            // Outside the state's lock: a runtime that is shutting down drops the task at
            // once, and its `Stop` (made here, so it runs even if the task is never polled)
            // takes that lock to say no reader runs.
            let stop = Stop {
                line: self.clone(),
                ended: false,
            };
            runtime.spawn(read_for_waiters(stop));
        }
        loop {
            let (watch, wants_write) = {
                let mut state = lock(&self.state);
                if let Some(outcome) = state.take(id) {
                    return outcome;
                }
                state.pump(&self.stream);
                if let Some(outcome) = state.take(id) {
                    return outcome;
                }
                (first || !state.reader, state.written < state.out.len())
            };
            // A completion, a break or the reader's end between the unlock and here
            // leaves a permit.
            tokio::select! {
                () = done.notified() => {}
                ready = self.stream.readable(), if watch => {
                    if let Err(e) = ready {
                        lock(&self.state).break_io(&e);
                    }
                }
                ready = self.stream.writable(), if watch && wants_write => {
                    if let Err(e) = ready {
                        lock(&self.state).break_io(&e);
                    }
                }
            }
        }
    }
}

/// Ends a reader's turn if its task is dropped mid-way or before it ran (its runtime
/// shutting down): says no reader runs, and wakes every waiting request.
struct Stop {
    line: Arc<Line>,
    ended: bool,
}

impl Drop for Stop {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let mut state = lock(&self.line.state);
        state.reader = false;
        for request in state.requests.values() {
            request.done.notify_one();
        }
    }
}

/// Reads for the requests of `stop`'s line while any wait, then ends. However it ends
/// (also when its runtime drops it, run or not), it says so, and wakes every waiting
/// request, which then watches the socket itself until another reader starts.
async fn read_for_waiters(mut stop: Stop) {
    let line = stop.line.clone();
    loop {
        let wants_write = {
            let mut state = lock(&line.state);
            state.pump(&line.stream);
            if state.broken.is_some() || state.queue.is_empty() {
                // Decided under the lock a request's submission takes: a request queued
                // after this starts a reader of its own, or is first and reads itself.
                state.reader = false;
                stop.ended = true;
                return;
            }
            state.written < state.out.len()
        };
        tokio::select! {
            ready = line.stream.readable() => {
                if let Err(e) = ready {
                    lock(&line.state).break_io(&e);
                }
            }
            ready = line.stream.writable(), if wants_write => {
                if let Err(e) = ready {
                    lock(&line.state).break_io(&e);
                }
            }
        }
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
                tcp: info.tcp_settings().clone(),
                slot: Mutex::new(Slot::Empty),
                home: Mutex::new(tokio::runtime::Handle::try_current().ok()),
                next_opening: std::sync::atomic::AtomicU64::new(0),
            }),
        };
        conn.line().await?;
        Ok(conn)
    }

    /// The line in use; if there is none (or it broke), the opening of the next one, which
    /// runs in a task of its own (bounded by the connect timeout) shared by every caller.
    /// A line that opened unusable (its runtime ended meanwhile) is replaced in turn, a
    /// few times at most.
    async fn line(&self) -> RedisResult<Arc<Line>> {
        // An opening runs within the connect timeout: one pending well past it is not being
        // run (its runtime is no longer driven) and is replaced.
        let stalled_after = self
            .shared
            .connect_timeout
            .saturating_add(Duration::from_secs(1));
        let mut last = None;
        for _ in 0..4 {
            let opening = {
                let mut slot = lock(&self.shared.slot);
                match &*slot {
                    Slot::Ready(line) if line.usable() => return Ok(line.clone()),
                    // An opening that ended without a line (its task dropped by a runtime
                    // that ended) is never handed out again, nor one that stalled.
                    Slot::Opening(opening, started, _)
                        if !opening.peek().is_some_and(Result::is_err)
                            && started.elapsed() < stalled_after =>
                    {
                        opening.clone()
                    }
                    Slot::Ready(_) | Slot::Empty | Slot::Opening(..) => {
                        if let Slot::Opening(opening, ..) = &*slot
                            && opening.peek().is_none()
                        {
                            // Stalled: home is not being driven (a `current_thread` runtime
                            // between its `block_on`s). The next openings run on the spare.
                            if let Some(spare) = spare_home() {
                                *lock(&self.shared.home) = Some(spare);
                            }
                        }
                        let number = self
                            .shared
                            .next_opening
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let opening = self.start_opening(number);
                        *slot = Slot::Opening(opening.clone(), std::time::Instant::now(), number);
                        opening
                    }
                }
            };
            match opening.await {
                Ok(line) if line.check(false) => return Ok(line),
                // Its runtime ended meanwhile: open another.
                Ok(line) => last = lock(&line.state).broken.clone(),
                // Its task was dropped unrun: open another (on another runtime).
                Err(failure) if failure.kind == io::ErrorKind::Interrupted => {
                    last = Some(failure);
                }
                Err(failure) => return Err(failure.redis()),
            }
        }
        Err(last
            .unwrap_or_else(|| Failure::new(io::ErrorKind::NotConnected, "no connection"))
            .redis())
    }

    /// Opens a line in a task on the home runtime (else the caller's, or inline without
    /// one), and puts it in the slot. If the home runtime has ended (the task is dropped
    /// unrun), [`spare_home`] becomes home, for the next opening.
    fn start_opening(&self, number: u64) -> Opening {
        let shared = self.shared.clone();
        let work = async move {
            let timeout = shared.connect_timeout;
            let outcome = match tokio::time::timeout(timeout, open(&shared)).await {
                Ok(Ok(line)) => Ok(line),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(Failure::new(
                    io::ErrorKind::TimedOut,
                    format!("connecting got no answer within {timeout:?}"),
                )),
            };
            let mut slot = lock(&shared.slot);
            if !matches!(&*slot, Slot::Opening(_, _, current) if *current == number) {
                // Replaced as stalled: a line from here would be a second one beside the
                // slot's, and commands sent on the two could run out of order. Its callers
                // ask again, for the slot's.
                return Err(Failure::new(
                    io::ErrorKind::Interrupted,
                    "the opening stalled and was replaced",
                ));
            }
            *slot = match &outcome {
                Ok(line) => Slot::Ready(line.clone()),
                Err(_) => Slot::Empty,
            };
            drop(slot);
            outcome
        };
        let caller = tokio::runtime::Handle::try_current().ok();
        let home = lock(&self.shared.home).clone().or_else(|| caller.clone());
        match home {
            Some(runtime) => {
                let task = runtime.spawn(work);
                let shared = self.shared.clone();
                async move {
                    task.await.unwrap_or_else(|e| {
                        if !e.is_cancelled() {
                            return Err(Failure::new(
                                io::ErrorKind::Other,
                                format!("opening the connection failed: {e}"),
                            ));
                        }
                        // Home has ended. Not the caller's runtime instead: it may end too,
                        // or (a `current_thread` one kept for `block_on`) never be driven
                        // again, with the line on it. One that is always driven.
                        *lock(&shared.home) = spare_home().or(caller);
                        Err(Failure::new(
                            io::ErrorKind::Interrupted,
                            format!("opening the connection was cut short: {e}"),
                        ))
                    })
                }
                .boxed()
                .shared()
            }
            None => work.boxed().shared(),
        }
    }

    /// Sends `bytes`, answered by `expected` replies (at least one), and waits for them.
    async fn exchange(&self, bytes: &[u8], expected: usize) -> RedisResult<Vec<Value>> {
        let timeout = self.shared.response_timeout;
        tokio::time::timeout(timeout, async {
            let line = self.line().await?;
            Ok(line.exchange(bytes, expected).await?)
        })
        .await
        .map_err(|_| {
            self.give_up_if_silent();
            timed_out("a request", timeout)
        })?
    }

    /// Gives the line in use up (the next request opens another) when its peer went silent
    /// at the TCP level: nothing heard from the server for the client's keepalive (the
    /// user timeout of its TCP settings), and the kernel sending unacknowledged data again,
    /// a few times at least. A server that is only stopped still acknowledges (and then
    /// announces a zero window, which is probed, not retransmitted to): its line is kept,
    /// with the order of the requests on it (see `conn::tcp::apply`). A line given up is
    /// aborted: what it still held for the server is never sent, also once the link comes
    /// back (helper-45's finding 1).
    fn give_up_if_silent(&self) {
        /// Retransmissions in a row before a line with nothing heard for the keepalive is
        /// taken for silent (about 1.4 s at least: a lost packet or two is not silence).
        const RETRANSMISSIONS: u32 = 3;
        let Some(after) = self.shared.tcp.user_timeout() else {
            return;
        };
        let line = match &*lock(&self.shared.slot) {
            Slot::Ready(line) => line.clone(),
            _ => return,
        };
        let quiet = {
            let mut state = lock(&line.state);
            // Once a second at most: reading `/proc/net/tcp` costs, and a stopped server
            // has every request time out.
            let due = state
                .silence_checked_at
                .is_none_or(|checked| checked.elapsed() >= Duration::from_secs(1));
            let quiet = due && state.heard_at.is_none_or(|heard| heard.elapsed() >= after);
            if quiet {
                state.silence_checked_at = Some(std::time::Instant::now());
            }
            quiet
        };
        if !quiet
            || crate::conn::tcp::retransmissions(&line.stream)
                .is_none_or(|count| count < RETRANSMISSIONS)
        {
            return;
        }
        lock(&line.state).break_with(Failure::new(
            io::ErrorKind::TimedOut,
            format!(
                "the server acknowledged nothing for {after:?} (keepalive): the line is given up"
            ),
        ));
        // The requests the kernel still holds for the server are dropped with the line, not
        // sent when the link comes back: their callers were told they failed, and the
        // requests they send next go on another line, which must not run before them. So
        // the kernel gives the line up at its next retransmission, without sending (a user
        // timeout long passed), and its close resets it (no linger). Only the reading side
        // is shut down: shutting the writing side down would queue a FIN and push the
        // output out with it.
        let socket = redis::io::tcp::socket2::SockRef::from(&line.stream);
        let _ = socket.set_tcp_user_timeout(Some(Duration::from_millis(1)));
        let _ = socket.set_linger(Some(Duration::ZERO));
        // Wakes a reader task waiting on the socket, which then sees the line broken.
        let _ = socket.shutdown(std::net::Shutdown::Read);
    }
}

/// A runtime of this module's own, driven by one thread (`lockkit-redis-io`), started the
/// first time a connection's home runtime is found ended: that connection's lines live on
/// it from then on. `None` if it cannot be started.
fn spare_home() -> Option<tokio::runtime::Handle> {
    static SPARE: std::sync::OnceLock<Option<tokio::runtime::Handle>> = std::sync::OnceLock::new();
    SPARE
        .get_or_init(|| {
            // Built on its own thread: a runtime dropped here, in an async context (its
            // thread failed to start), would panic.
            let (sender, receiver) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("lockkit-redis-io".into())
                .spawn(move || {
                    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    else {
                        return;
                    };
                    if sender.send(runtime.handle().clone()).is_ok() {
                        runtime.block_on(std::future::pending::<()>());
                    }
                })
                .ok()?;
            receiver.recv().ok()
        })
        .clone()
}

/// A new line, authenticated and on the configured database.
async fn open(shared: &Shared) -> Result<Arc<Line>, Failure> {
    let io_failure = |e: io::Error| Failure::of(&e);
    let stream = TcpStream::connect((shared.host.as_str(), shared.port))
        .await
        .map_err(io_failure)?;
    // No Nagle delay whatever the client says: requests are written as they come.
    crate::conn::tcp::apply(&stream, &shared.tcp.clone().set_nodelay(true)).map_err(io_failure)?;
    let line = Arc::new(Line {
        stream,
        state: Mutex::new(LineState {
            heard_at: Some(std::time::Instant::now()),
            ..LineState::default()
        }),
        runtime: tokio::runtime::Handle::try_current().ok(),
    });
    let refused = |what: &str, kind: ErrorKind, reply: Value| -> Result<(), Failure> {
        match reply {
            Value::ServerError(e) => Err(Failure {
                kind: io::ErrorKind::PermissionDenied,
                // The server's words only, never the credentials: a server that does not
                // know AUTH (renamed) quotes its arguments back.
                message: redact(
                    &format!(
                        "the server refused {what}: {} {}",
                        e.code(),
                        e.details().unwrap_or("")
                    ),
                    shared.password.as_deref(),
                ),
                refused: Some(kind),
            }),
            _ => Ok(()),
        }
    };
    if let Some(password) = &shared.password {
        let auth = |username: Option<&str>| {
            let mut cmd = redis::cmd("AUTH");
            if let Some(username) = username {
                cmd.arg(username);
            }
            cmd.arg(password);
            cmd.get_packed_command()
        };
        let mut reply = one(line
            .exchange(&auth(shared.username.as_deref()), 1)
            .await
            .map_err(io_failure)?)?;
        // A server without ACLs (before Redis 6) takes only the password, as redis-rs retries.
        if shared.username.is_some()
            && matches!(&reply, Value::ServerError(e)
                if e.details().is_some_and(|d| d.contains("wrong number of arguments")))
        {
            reply = one(line.exchange(&auth(None), 1).await.map_err(io_failure)?)?;
        }
        refused(
            "the credentials (AUTH)",
            ErrorKind::AuthenticationFailed,
            reply,
        )?;
    }
    if shared.db != 0 {
        let select = redis::cmd("SELECT").arg(shared.db).get_packed_command();
        let reply = one(line.exchange(&select, 1).await.map_err(io_failure)?)?;
        refused("SELECT", ErrorKind::InvalidClientConfig, reply)?;
    }
    Ok(line)
}

/// `text` with every occurrence of `secret` masked.
fn redact(text: &str, secret: Option<&str>) -> String {
    match secret.filter(|secret| !secret.is_empty()) {
        Some(secret) => text.replace(secret, "***"),
        None => text.to_owned(),
    }
}

fn one(mut replies: Vec<Value>) -> Result<Value, Failure> {
    replies.pop().ok_or_else(|| {
        Failure::new(
            io::ErrorKind::InvalidData,
            "a request was answered by no reply",
        )
    })
}

impl ConnectionLike for DirectConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let replies = self.exchange(&cmd.get_packed_command(), 1).await?;
            one(replies)
                .map_err(|failure| failure.redis())?
                .extract_error()
        })
    }

    /// The replies as the server gave them (errors included): redis-rs's pipeline makes
    /// them its result, as with its own connections. An empty pipeline sends nothing.
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            if offset + count == 0 {
                return Ok(Vec::new());
            }
            let mut replies = self
                .exchange(&pipeline.get_packed_pipeline(), offset + count)
                .await?;
            Ok(replies.drain(offset.min(replies.len())..).collect())
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_REPLY_DEPTH, frame_len};

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

    #[test]
    fn frame_lengths_refuse_arrays_nested_past_the_bound() {
        let nested = |levels: usize| {
            let mut reply = b"*1\r\n".repeat(levels);
            reply.extend_from_slice(b":1\r\n");
            reply
        };
        let deepest = nested(MAX_REPLY_DEPTH);
        assert_eq!(frame_len(&deepest, 0), Ok(Some(deepest.len())));
        assert!(frame_len(&nested(MAX_REPLY_DEPTH + 1), 0).is_err());
        // Empty arrays at the bound nest nothing further.
        let mut empty = b"*1\r\n".repeat(MAX_REPLY_DEPTH);
        empty.extend_from_slice(b"*0\r\n");
        assert_eq!(frame_len(&empty, 0), Ok(Some(empty.len())));
    }
}
