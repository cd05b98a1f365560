// The modules of the `alone` tests, included by main.rs (built against
// RabbitMQ 3.10, or NACKD_TEST_BROKER) and main43.rs (built against 4.3):
// one list, so that both binaries run the same tests.

#[path = "../common/mod.rs"]
mod common;

mod book;
mod broker_restart;
mod client_suites;
mod deb;
mod due_backlog;
mod image;
mod quickstart;
mod restart;
mod structure;
