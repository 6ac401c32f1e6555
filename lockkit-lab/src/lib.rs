//! # lockkit-lab
//!
//! The fault lab: scenarios that break something real (a frozen holder, a frozen or
//! killed server, a cut link, a failover, a Redlock master that forgot) and show what each
//! backend does, with a timeline and a checked history.
//!
//! Every scenario declares what it expects, as three observations:
//!
//! - **double grant**: did two holders believe they held the key at once? (The [`History`]
//!   checker decides, from each holder's grant and the end of its belief.)
//! - **lost signalled**: did the first holder's guard fire lost, and before or after a
//!   rival was granted?
//! - **stale write refused**: when a holder that was superseded wrote with its fencing
//!   token after the newer holder wrote, did the fenced store refuse it?
//!
//! A run whose observations differ from the expectation fails, in both directions: an
//! expected double grant that does not happen fails as loudly as an unexpected one. A
//! token that does not grow fails always.
//!
//! The lab drives the private servers of `scripts/services.sh` (pause, kill, restart) and
//! restores them after every scenario, so run scenarios one at a time (the runner does).
//! It is backend-agnostic: it is handed a [`Connect`] function (the `lockkit` facade's
//! `backend(url)`) and the command that starts its child holder process. It is a tool, not
//! a library for lock users, and never a backend crate's dependency: backends test with
//! `lockkit-conformance`; the lab runs them through the facade.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod child;
mod markdown;
mod report;
mod scenarios;
mod servers;
mod store;
pub mod svg;
mod timeline;

use std::{
    collections::BTreeMap,
    fmt,
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use lockkit_core::{LockBackend, Locker};

pub use child::{CHILD_VAR, child_main, child_requested};
pub use lockkit_conformance::env::zk_mode;
pub use markdown::{
    DOC_BEGIN, DOC_END, PICTURES_DIR, TIMELINES_BEGIN, TIMELINES_END, render_document,
    render_table, render_timelines, splice_table, update_document,
};
pub use report::{Expect, LostSignal, Observed, Report, Stale};
pub use scenarios::{CATALOGUE, ScenarioDef};
pub use servers::{Instance, Services, parse_instances, redis_command, url_vars};
pub use store::{FencedStore, StaleWrite, StoreKind};
pub use timeline::{Actor, Event, Mark, WriteOutcome};

/// Builds a backend from a URL (the facade's `lockkit::backend`).
pub type Connect = Arc<
    dyn Fn(
            String,
        )
            -> Pin<Box<dyn Future<Output = lockkit_core::Result<Arc<dyn LockBackend>>> + Send>>
        + Send
        + Sync,
>;

/// A failure of the lab itself or of a scenario's expectation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabError(pub String);

impl fmt::Display for LabError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LabError {}

impl LabError {
    /// An error with a message.
    pub fn new(message: impl Into<String>) -> Self {
        LabError(message.into())
    }
}

/// Adds context to lockkit errors and I/O errors.
pub trait Context<T> {
    /// Wraps the error as `what: error`.
    fn context(self, what: impl fmt::Display) -> Result<T, LabError>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: impl fmt::Display) -> Result<T, LabError> {
        self.map_err(|e| LabError(format!("{what}: {e}")))
    }
}

/// How to start the lab's child holder: a program and its arguments (the test binary or
/// the `lockkit` binary, re-run in its child mode).
#[derive(Debug, Clone)]
pub struct ChildCommand {
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
}

/// Everything a scenario needs: how to connect, the servers, their URLs, a scratch
/// directory.
#[derive(Clone)]
pub struct Lab {
    connect: Connect,
    child: ChildCommand,
    services: Services,
    urls: BTreeMap<String, String>,
    scratch: PathBuf,
    live: bool,
}

impl fmt::Debug for Lab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lab")
            .field("child", &self.child)
            .field("services", &self.services)
            .field("urls", &self.urls)
            .field("scratch", &self.scratch)
            .finish_non_exhaustive()
    }
}

impl Lab {
    /// A lab on the servers of `services`, with URLs from the environment when every URL
    /// variable of the instance table ([`Services::instances`]) is set, else from
    /// `services.sh env`.
    ///
    /// # Errors
    /// When the instance table cannot be read, or `services.sh env` cannot be run or lacks
    /// a URL.
    pub async fn new(
        connect: Connect,
        child: ChildCommand,
        services: Services,
    ) -> Result<Lab, LabError> {
        let url_vars = servers::url_vars(&services.instances()?);
        let from_env: BTreeMap<String, String> = url_vars
            .iter()
            .filter_map(|var| {
                std::env::var(var)
                    .ok()
                    .filter(|v| !v.is_empty())
                    .map(|v| (var.clone(), v))
            })
            .collect();
        let urls = if from_env.len() == url_vars.len() {
            // Servers belong to the script that started them: URLs from the environment
            // must come with the script that printed them, or the lab would pause and kill
            // another checkout's servers while it tests these.
            let printed_by = std::env::var_os("LOCKKIT_SERVICES_SCRIPT").map(PathBuf::from);
            let same = |p: &std::path::Path| std::fs::canonicalize(p).ok();
            if printed_by.as_deref().and_then(same) != same(services.script()) {
                return Err(LabError::new(
                    "the server URLs come from the environment, but LOCKKIT_SERVICES_SCRIPT \
                     does not name the script the lab would drive: run \
                     `eval \"$(scripts/services.sh env)\"` again in the checkout whose servers \
                     these are",
                ));
            }
            from_env
        } else {
            services.urls().await?
        };
        if let Some(missing) = url_vars.iter().find(|v| !urls.contains_key(*v)) {
            return Err(LabError::new(format!(
                "`{} env` does not print {missing}; is the script up to date?",
                services.script().display()
            )));
        }
        let scratch = services.state_dir().join("lab");
        std::fs::create_dir_all(&scratch)
            .context(format!("cannot create {}", scratch.display()))?;
        Ok(Lab {
            connect,
            child,
            services,
            urls,
            scratch,
            live: false,
        })
    }

    /// Prints each timeline event as it happens (for the CLI).
    pub fn live(mut self, live: bool) -> Self {
        self.live = live;
        self
    }

    /// The servers.
    pub fn services(&self) -> &Services {
        &self.services
    }

    /// The URL in `var` (a URL variable of the instance table).
    fn url(&self, var: &str) -> Result<&str, LabError> {
        self.urls
            .get(var)
            .map(String::as_str)
            .ok_or_else(|| LabError::new(format!("no URL for {var}")))
    }

    /// A backend for `url`.
    async fn backend(&self, url: &str) -> Result<Arc<dyn LockBackend>, LabError> {
        (self.connect)(url.to_owned())
            .await
            .context(format!("connecting to {url}"))
    }

    /// A locker (a client of its own) for `url`.
    async fn locker(&self, url: &str) -> Result<Locker, LabError> {
        Ok(Locker::from_arc(self.backend(url).await?))
    }

    fn scratch(&self) -> &Path {
        &self.scratch
    }
}

/// Runs one scenario, restores the servers it touched, and checks what it saw against
/// what it expects. The report says what happened even when the run failed.
pub async fn run(lab: &Lab, def: &ScenarioDef) -> Report {
    scenarios::run(lab, def).await
}

/// The scenario `scenario` on `backend`, if the catalogue has it.
pub fn find(scenario: &str, backend: &str) -> Option<&'static ScenarioDef> {
    CATALOGUE
        .iter()
        .find(|d| d.scenario == scenario && d.backend == backend)
}

/// How long a scenario may take.
pub const SCENARIO_LIMIT: Duration = Duration::from_secs(60);
