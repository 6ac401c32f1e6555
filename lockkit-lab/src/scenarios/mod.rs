//! The scenarios, split by concern: the catalogue (what each breaks and expects), one
//! run's state, the runner, the steps plans share, and the plans, one module per backend
//! family (and one for plans that work on any backend).

mod any_backend;
mod catalogue;
mod ctx;
mod etcd;
mod mysql;
mod redis;
mod run;
mod steps;
mod zookeeper;

pub use catalogue::{CATALOGUE, ScenarioDef};
pub(crate) use run::run;
