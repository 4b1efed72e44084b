//! Cluster tests: real nodes (in this process, or as processes where a signal is the point)
//! with real HTTP on loopback ports the OS picks and real sled in temp dirs.

mod answers;
mod balance;
mod client;
mod crash;
mod eviction;
mod failover;
mod faults;
mod harness;
mod maintenance;
mod membership;
mod mirrors;
mod process;
mod readme;
mod restart;
mod routing;
mod statefulset;
mod tls;
mod transfer;
mod workload;
