//! Which member of the cluster a request, or a keep-alive stream, goes to.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use etcd_client::Client;
use tokio::time::Instant;

/// How long a member that left a try unanswered, or failed one on the way, is passed over
/// at least: long enough that a frozen or dead member costs one try's wait now and then
/// rather than on a third of all requests.
pub(crate) const PASS_OVER: Duration = Duration::from_secs(10);

/// What the last tries told of one member.
#[derive(Clone, Copy, Default)]
struct Mark {
    /// Until when the member is passed over (`None`: it answered last).
    until: Option<Instant>,
    /// When it last failed a try, or was last picked to be tried again: of members that are
    /// all passed over, the one heard of least recently goes first.
    since: Option<Instant>,
}

/// A member's client that can be told to open a new connection.
pub(crate) trait Reconnect {
    /// From now on, sends new requests and streams to `endpoint` through a new connection
    /// (the old one goes once the streams still on it end).
    fn reconnect(&self, endpoint: &str);
}

impl Reconnect for Client {
    /// etcd-client's channel replaces its connection to an endpoint added again with the
    /// new one once that is ready.
    fn reconnect(&self, endpoint: &str) {
        let (client, endpoint) = (self.clone(), endpoint.to_owned());
        tokio::spawn(async move {
            if let Err(error) = client.add_endpoint(&endpoint).await {
                tracing::debug!(endpoint, %error, "could not open a new connection");
            }
        });
    }
}

/// The cluster's members, a client of each, and which one a request goes to first.
///
/// etcd-client's own client spreads requests over the members at random (tonic's
/// power-of-two-choices balancer with no load measure), so a try sent again after a frozen
/// member left it unanswered went to that member again one time in three, and a request
/// with two tries in its limit failed one time in nine with one member of three frozen.
///
/// Here requests start on the members in turn. A member that leaves a try unanswered or
/// fails it is passed over (by first tries, retries and keep-alive streams alike) for
/// [`PASS_OVER`] or four tries' time, whichever is longer; when that runs out, one request
/// tries it again while the others still pass it over. When every member a caller has not
/// tried yet is passed over, the one heard of least recently goes first.
pub(crate) struct Members<C = Client> {
    clients: Box<[C]>,
    /// The endpoint of each client (`http://host:port`), to open a new connection to.
    endpoints: Box<[String]>,
    /// When each member was last given a new connection.
    reconnected: Box<[Mutex<Option<Instant>>]>,
    /// Where the next request starts (round robin).
    next: AtomicUsize,
    marks: Box<[Mutex<Mark>]>,
    /// How long one try may stay unanswered.
    per_try: Duration,
}

impl<C> Members<C> {
    /// One client per member (at least one), of the endpoint at the same place in
    /// `endpoints`, whose tries may stay unanswered `per_try`.
    pub(crate) fn new(clients: Vec<C>, endpoints: Vec<String>, per_try: Duration) -> Self {
        let marks = clients.iter().map(|_| Mutex::default()).collect();
        Members {
            reconnected: clients.iter().map(|_| Mutex::default()).collect(),
            clients: clients.into(),
            endpoints: endpoints.into(),
            next: AtomicUsize::new(0),
            marks,
            per_try,
        }
    }

    /// The client of member `member`.
    pub(crate) fn client(&self, member: usize) -> &C {
        &self.clients[member % self.clients.len()]
    }

    fn mark(&self, member: usize) -> std::sync::MutexGuard<'_, Mark> {
        self.marks[member % self.clients.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The member a new request or keep-alive stream starts on.
    pub(crate) fn first(&self) -> usize {
        let start = self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        self.pick(start, &[])
    }

    /// The member to ask after `member` (just tried, and added to `tried`): the next in
    /// turn that is neither in `tried` nor passed over; else, of those not in `tried`, the
    /// one heard of least recently; once every member is in `tried`, `tried` starts afresh
    /// with `member` alone.
    pub(crate) fn next_avoiding(&self, member: usize, tried: &mut Vec<usize>) -> usize {
        let n = self.clients.len();
        let member = member % n;
        if !tried.contains(&member) {
            tried.push(member);
        }
        if tried.len() >= n {
            tried.clear();
            tried.push(member);
        }
        self.pick((member + 1) % n, tried)
    }

    /// From `start` on in turn: the first member not in `avoid` that is not passed over
    /// (one whose pass-over ran out is marked for one try's time, so that concurrent
    /// requests do not all try it again at once); else the member not in `avoid` heard of
    /// least recently; else `start`.
    fn pick(&self, start: usize, avoid: &[usize]) -> usize {
        let n = self.clients.len();
        if n == 1 {
            return 0;
        }
        let now = Instant::now();
        let mut least_recent: Option<(Option<Instant>, usize)> = None;
        for member in (0..n).map(|i| (start + i) % n) {
            if avoid.contains(&member) {
                continue;
            }
            let mut mark = self.mark(member);
            match mark.until {
                None => return member,
                Some(until) if until <= now => {
                    *mark = Mark {
                        until: Some(now + self.per_try),
                        since: Some(now),
                    };
                    return member;
                }
                Some(_) => {
                    if least_recent.is_none_or(|(since, _)| mark.since < since) {
                        least_recent = Some((mark.since, member));
                    }
                }
            }
        }
        least_recent.map_or(start, |(_, member)| member)
    }

    /// `member` left a try unanswered or failed it on the way: pass it over for a while.
    pub(crate) fn failed(&self, member: usize) {
        if self.clients.len() > 1 {
            let now = Instant::now();
            *self.mark(member) = Mark {
                until: Some(now + PASS_OVER.max(self.per_try * 4)),
                since: Some(now),
            };
        }
    }

    /// `member` left a try or a keep-alive unanswered for a whole try's time: passed over
    /// (see [`Members::failed`]), and given a new connection (at most once a try's time).
    ///
    /// A connection can go silent while its member is fine and new connections reach it (a
    /// NAT or load balancer on the way forgot it: nothing is acknowledged, nothing comes
    /// back). Nothing fails on it until HTTP/2's ping gives up (6 s, and `connect_timeout`
    /// more), past the loss deadline of a 10 s etcd lease (2/3 of it): with one member, every
    /// keep-alive went to the silent connection until the hold was lost.
    pub(crate) fn unanswered(&self, member: usize)
    where
        C: Reconnect,
    {
        self.failed(member);
        let member = member % self.clients.len();
        let now = Instant::now();
        {
            let mut last = self.reconnected[member]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|at| now < at + self.per_try) {
                return;
            }
            *last = Some(now);
        }
        if let Some(endpoint) = self.endpoints.get(member) {
            self.clients[member].reconnect(endpoint);
        }
    }

    /// `member` answered: no longer passed over.
    pub(crate) fn answered(&self, member: usize) {
        let mut mark = self.mark(member);
        if mark.until.is_some() {
            *mark = Mark::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Reconnect for &str {
        fn reconnect(&self, _: &str) {}
    }

    fn three() -> Members<&'static str> {
        let endpoints = ["a", "b", "c"].map(String::from).to_vec();
        Members::new(vec!["a", "b", "c"], endpoints, Duration::from_millis(500))
    }

    #[tokio::test(start_paused = true)]
    async fn requests_start_on_the_members_in_turn() {
        let members = three();
        let firsts: Vec<usize> = (0..6).map(|_| members.first()).collect();
        assert_eq!(firsts, [0, 1, 2, 0, 1, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_member_is_passed_over_until_its_time_runs_out() {
        let members = three();
        members.failed(1);
        let firsts: Vec<usize> = (0..6).map(|_| members.first()).collect();
        assert!(!firsts.contains(&1), "{firsts:?}");
        tokio::time::advance(PASS_OVER + Duration::from_millis(1)).await;
        // One request tries it again; the others pass it over while that try runs.
        let firsts: Vec<usize> = (0..6).map(|_| members.first()).collect();
        assert_eq!(firsts.iter().filter(|&&m| m == 1).count(), 1, "{firsts:?}");
        members.answered(1);
        let firsts: Vec<usize> = (0..3).map(|_| members.first()).collect();
        assert!(firsts.contains(&1), "{firsts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn retries_reach_every_other_member_before_one_comes_back() {
        let members = three();
        // Every member passed over, 1 longest ago.
        members.failed(1);
        tokio::time::advance(Duration::from_millis(10)).await;
        members.failed(0);
        tokio::time::advance(Duration::from_millis(10)).await;
        members.failed(2);
        let mut tried = Vec::new();
        let second = members.next_avoiding(2, &mut tried);
        assert_eq!(second, 1, "the member heard of least recently");
        members.failed(1);
        let third = members.next_avoiding(second, &mut tried);
        assert_eq!(third, 0, "the one member not yet tried");
        members.failed(0);
        let fourth = members.next_avoiding(third, &mut tried);
        assert_ne!(fourth, 0, "the member just tried, again");
    }

    /// The keep-alive order of a frozen leader (0): a healthy member (1) passed over by a
    /// request that waited on the leader, the next (2) failing too before the election: the
    /// stream goes to 1, not back to the frozen 0.
    #[tokio::test(start_paused = true)]
    async fn a_stream_does_not_go_back_to_the_member_that_failed_it() {
        let members = three();
        members.failed(1);
        tokio::time::advance(Duration::from_secs(1)).await;
        let mut tried = Vec::new();
        members.failed(0);
        let next = members.next_avoiding(0, &mut tried);
        assert_eq!(next, 2);
        tokio::time::advance(Duration::from_secs(1)).await;
        members.failed(2);
        assert_eq!(members.next_avoiding(2, &mut tried), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn one_member_is_always_asked() {
        let members = Members::new(
            vec!["only"],
            vec!["only".into()],
            Duration::from_millis(500),
        );
        members.failed(0);
        let mut tried = Vec::new();
        assert_eq!(members.first(), 0);
        assert_eq!(members.next_avoiding(0, &mut tried), 0);
    }
}
