// The modules of the `it` tests, included by main.rs (built against
// RabbitMQ 3.10, or NACKD_TEST_BROKER) and main43.rs (built against 4.3):
// one list, so that both binaries run the same tests.

#[path = "../common/mod.rs"]
mod common;

mod alerts;
mod brokers;
mod cli;
mod clock;
mod cluster;
mod cluster_adopt;
mod cluster_replica;
mod cluster_smoke;
mod coalesce;
mod deferral;
mod delayed;
mod delayed_registry;
mod deploy;
mod durability;
mod hot_reload;
mod isolation;
mod kubernetes;
mod ops;
mod option_c;
mod proxy;
mod replay;
mod replica;
mod republisher_health;
mod resilience;
mod retry;
mod screen;
mod status_page;
mod store;
mod store_stall;
mod tls;
mod trust;
