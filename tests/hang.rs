//! An API connection that stops answering mid-request: the agent's request
//! fails at its deadline instead of waiting forever, `/livez` stays green,
//! and the condition reaches the Node on a new connection once the network
//! is back. (A frozen proxy that refuses new connections is the easy case;
//! here the established connection swallows everything, for good.)

mod support;

use std::time::{Duration, Instant};

use nodeguard::report::Status;
use support::proxy::BlackholeProxy;
use support::*;

#[tokio::test]
async fn a_request_on_a_connection_that_stops_answering_fails_at_its_deadline() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "hang", &[]).await;
    let proxy = BlackholeProxy::in_front_of_the_api_server().await;
    let through_proxy = proxy.client().await;
    let (agent, _state) = start_agent(through_proxy, &node.name).await;
    eventually(Duration::from_secs(30), "agent ready", || async {
        http_get(agent.addr, "/readyz").await.0 == 200
    })
    .await;
    agent
        .reporter
        .set("HangProbe", desired(Status::False, "Before", "before."));
    wait_condition(
        &admin,
        &node.name,
        "HangProbe",
        "False",
        Duration::from_secs(20),
        "first write",
    )
    .await;

    // Every connection open now (the watches', the writer's pooled one)
    // swallows what is sent from here on, and stays dead.
    proxy.freeze();
    agent
        .reporter
        .set("HangProbe", desired(Status::True, "During", "during."));
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.thaw();
    let thawed = Instant::now();
    eventually(
        Duration::from_secs(40),
        "the change on the Node through a new connection",
        || async { condition_is(&admin, &node.name, "HangProbe", "True").await },
    )
    .await;
    eprintln!(
        "condition written {:?} after the network came back",
        thawed.elapsed()
    );
    let (code, body) = http_get(agent.addr, "/livez").await;
    assert_eq!(code, 200, "a hung request is not a stuck agent: {body}");
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        sample(
            &metrics,
            "nodeguard_api_write_errors_total{resource=\"nodes/status\"}"
        )
        .is_some_and(|v| v >= 1.0),
        "the timed-out write is counted:\n{metrics}"
    );
    agent.stop().await;
}
