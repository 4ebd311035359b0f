//! Probe workers with the kubelet prober's semantics.
pub mod core;
pub mod prober;
