//! Unit tests of the client's pure parts: routing by a map, and options as query parameters.

use std::time::Duration;

use shoal_http_api::types::{MapNode, MapView};

use super::*;

#[test]
fn routes_send_each_key_to_its_bucket_owner() {
    let owners: Vec<NodeId> = (0..1000).map(|b| if b < 500 { 1 } else { 2 }).collect();
    let nodes = vec![
        MapNode { id: 1, api_addr: "a:1".into(), replica_on: Some(2) },
        MapNode { id: 2, api_addr: "b:2".into(), replica_on: Some(1) },
    ];
    let routes = Routes::from(MapView { version: 7, owners, nodes });
    assert_eq!(routes.version, 7);
    for key in ["a", "user:42", "{tag}x"] {
        let bucket = shoal_raft::bucket_of(key.as_bytes());
        let expected = if bucket.index() < 500 { 1 } else { 2 };
        assert_eq!(routes.owner_of_key(key.as_bytes()), Some(expected));
    }
    assert_eq!(routes.addr_of(2), Some("b:2"));
    assert_eq!(routes.addr_of(3), None);
    assert_eq!(routes.node_ids().collect::<Vec<_>>(), vec![1, 2]);
}

#[test]
fn put_options_become_the_query_the_server_reads() {
    let options = PutOptions {
        ttl: Some(Duration::from_secs(90)),
        sliding: None,
        cas: Some(3),
        mode: None,
        tags: vec!["a".into(), "b".into()],
        priority: Some(Priority::High),
    };
    let query = options.query();
    assert_eq!(
        query,
        vec![("ttl", "90000ms".into()), ("cas", "3".into()), ("tags", "a,b".into()), ("priority", "high".into())]
    );
    for (name, value) in &query {
        if *name == "ttl" {
            assert_eq!(shoal_http_api::parse_duration("ttl", value).ok(), Some(Duration::from_secs(90)));
        }
    }
    assert!(PutOptions::default().query().is_empty());
}

#[test]
fn errors_keep_the_server_code_and_status() {
    let e = ClientError::Unavailable { code: "no_leader".into(), detail: "election".into(), retry_after: None };
    assert_eq!((e.code(), e.status()), (Some("no_leader"), Some(503)));
    let e = ClientError::PreconditionFailed { current_version: Some(4), detail: "cas".into() };
    assert_eq!((e.code(), e.status()), (Some("precondition_failed"), Some(412)));
    let e = ClientError::Connection { node: Some(2), detail: "refused".into(), maybe_applied: true };
    assert_eq!((e.code(), e.status()), (None, None));
    assert!(e.to_string().contains("may have been applied"), "{e}");
}

#[test]
fn read_options_ask_for_mirrors_and_staleness() {
    let options = ReadOptions { read: Some(ReadFrom::Mirrors), max_staleness: Some(Duration::from_secs(2)) };
    assert_eq!(options.query(), vec![("read", "mirrors".into()), ("max_staleness", "2000ms".into())]);
    let fresh = ReadOptions { read: Some(ReadFrom::Owner), max_staleness: Some(Duration::ZERO) };
    assert_eq!(fresh.query(), vec![("read", "owner".into()), ("max_staleness", "0".into())]);
}
