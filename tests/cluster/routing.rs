//! Routing: any node serves any key, forwarding to the owner; keyless operations see every
//! node; forwarded requests are refused by non-owners.

use futures::StreamExt;
use serde_json::{json, Value};
use shoal_raft::bucket_of;

use crate::harness::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_through_one_node_is_read_through_every_other() {
    let c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    for i in 0..60 {
        assert_eq!(c.put(i % 3, &format!("user:{i}"), &format!("value {i}")).await, 200);
    }
    for i in 0..60 {
        for slot in 0..3 {
            assert_eq!(c.get(slot, &format!("user:{i}")).await, Some(format!("value {i}")), "user:{i} via {slot}");
        }
    }
    // The key's holder is its bucket's owner, whichever node answered.
    let map = c.json(0, "/v1/cluster/map").await;
    let r = c.http.get(c.url(1, "/v1/kv/user:7")).send().await.expect("get");
    let bucket = bucket_of(b"user:7").0;
    assert_eq!(r.headers()["x-shoal-bucket"], bucket.to_string().as_str());
    assert_eq!(r.headers()["x-shoal-node"], map["owners"][bucket as usize].to_string().as_str());
    // Keys with characters that need escaping arrive whole at their owner, whichever node
    // forwards them.
    for key in ["a/b c", "100%", "ü:{tag}?x=1#y", "plus+and&"] {
        let url = |slot| {
            let mut u = reqwest::Url::parse(&c.url(slot, "/v1/kv/")).expect("url");
            u.path_segments_mut().expect("base").pop_if_empty().push(key);
            u
        };
        for slot in 0..3 {
            let r = c.http.put(url(slot)).body(format!("{key}@{slot}")).send().await.expect("put");
            assert_eq!(r.status(), 200, "PUT {key:?} via {slot}");
            for reader in 0..3 {
                let got = c.http.get(url(reader)).send().await.expect("get").text().await.expect("body");
                assert_eq!(got, format!("{key}@{slot}"), "GET {key:?} via {reader}");
            }
        }
    }
    // Deletes are forwarded too.
    let r = c.http.delete(c.url(2, "/v1/kv/user:7")).send().await.expect("delete");
    assert_eq!(r.status(), 204);
    assert_eq!(c.get(0, "user:7").await, None);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_prefixes_and_bulk_operations_see_every_node() {
    let c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let items: Vec<Value> = (0..30)
        .map(|i| json!({"key": format!("p:{i:02}"), "value": format!("v{i}"), "tags": if i % 2 == 0 { vec!["even"] } else { vec![] }}))
        .collect();
    let r = c.http.post(c.url(1, "/v1/bulk/put")).json(&json!({ "items": items })).send().await.expect("bulk put");
    let put: Value = r.json().await.expect("json");
    assert!(put["results"].as_array().expect("results").iter().all(|r| r["error"].is_null()), "{put}");
    c.put(2, "other", "x").await;

    let listed = c.json(0, "/v1/kv?prefix=p:&limit=100").await;
    let keys: Vec<&str> =
        listed["keys"].as_array().expect("keys").iter().map(|k| k["key"].as_str().expect("key")).collect();
    let expected: Vec<String> = (0..30).map(|i| format!("p:{i:02}")).collect();
    assert_eq!(keys, expected);
    assert_eq!(listed["incomplete"], false);
    let nodes: std::collections::BTreeSet<u64> =
        listed["keys"].as_array().expect("keys").iter().map(|k| k["node"].as_u64().expect("node")).collect();
    assert_eq!(nodes.len(), 3, "the keys came from every node");
    assert_eq!(c.json(2, "/v1/kv?prefix=p:&limit=5").await["keys"].as_array().expect("keys").len(), 5);

    let tagged = c.json(1, "/v1/tags/even").await;
    assert_eq!(tagged["keys"].as_array().expect("keys").len(), 15);

    // Pages of a listing merged from every node: each key once, in order, `more` until the end.
    for (path, expected) in [("/v1/kv?prefix=p:&limit=7", 30), ("/v1/tags/even?limit=4", 15)] {
        let mut seen: Vec<String> = Vec::new();
        let mut after = String::new();
        for page in 0.. {
            assert!(page < 10, "{path}: the pages end");
            let list = c.json(page % 3, &format!("{path}&start_after={after}")).await;
            seen.extend(list["keys"].as_array().expect("keys").iter().map(|k| k["key"].as_str().expect("key").into()));
            if list["more"] == false {
                break;
            }
            after = list["next"].as_str().expect("next").to_string();
            assert_eq!(Some(&after), seen.last(), "{list}");
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!((seen.len(), &sorted), (expected, &seen), "{path}");
    }

    let keys: Vec<String> = (0..32).map(|i| format!("p:{i:02}")).collect();
    let got: Value = c
        .http
        .post(c.url(2, "/v1/bulk/get"))
        .json(&json!({ "keys": keys }))
        .send()
        .await
        .expect("bulk get")
        .json()
        .await
        .expect("json");
    let results = got["results"].as_array().expect("results");
    assert_eq!(results.len(), 32);
    assert_eq!(results[3]["value"], "v3");
    assert_eq!(results[31]["found"], false);

    let removed: Value =
        c.http.delete(c.url(0, "/v1/tags/even")).send().await.expect("remove").json().await.expect("json");
    assert_eq!(removed["removed"], 15);
    assert_eq!(c.get(1, "p:04").await, None);
    assert_eq!(c.get(1, "p:05").await.as_deref(), Some("v5"));

    let deleted = c.post_json(1, "/v1/bulk/delete", &json!({"keys": ["p:05", "p:06"]})).await;
    assert_eq!(deleted["results"][0]["deleted"], true);
    assert_eq!(deleted["results"][1]["deleted"], false);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_pose_as_a_forwarding_node_and_redirects_point_to_the_owner() {
    let c = TestCluster::start(2).await;
    let version = c.wait_for_counts(&[500, 500]).await;
    let map = c.json(0, "/v1/cluster/map").await;
    let owner_of = |key: &str| map["owners"][bucket_of(key.as_bytes()).0 as usize].as_u64().expect("owner");
    let key = (0..).map(|i| format!("k{i}")).find(|k| owner_of(k) == c.id(1)).expect("a key of node 2");
    assert!(c.put(1, &key, "v").await.is_success());

    // Forwards come over the peer link only: headers the nodes once sent each other through
    // the public API (the sender's map version, a deadline, a mirror read) are a client's
    // headers like any other, and the request is routed as every client's is.
    for (name, value) in
        [("x-shoal-map-version", version.to_string()), ("x-shoal-map-version", (version + 1000).to_string())]
            .into_iter()
            .chain([("x-shoal-deadline-ms", "1".to_string()), ("x-shoal-mirror-read", "0".to_string())])
    {
        let r = c.http.get(c.url(0, &format!("/v1/kv/{key}"))).header(name, &value).send().await.expect("get");
        assert_eq!(r.status(), 200, "{name}: {value}");
        let bulk = serde_json::json!({"items": [{"key": key, "value": "w"}]});
        let r = c.http.post(c.url(0, "/v1/bulk/put")).header(name, &value).json(&bulk).send().await.expect("bulk");
        let answer: Value = r.json().await.expect("json");
        assert!(answer["results"][0]["version"].is_u64(), "{name}: {answer}");
    }

    let r = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
        .put(c.url(0, &format!("/v1/kv/{key}?redirect=true&ttl=5m")))
        .body("v")
        .send()
        .await
        .expect("put");
    assert_eq!(r.status(), 307);
    assert_eq!(r.headers()["location"], c.url(1, &format!("/v1/kv/{key}?ttl=5m")).as_str());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_conditional_writes_fail_whole_through_any_node() {
    let c = TestCluster::start(2).await;
    c.wait_for_counts(&[500, 500]).await;
    let big = "x".repeat(1024 * 1024 + 1);
    let r = c.http.put(c.url(0, "/v1/kv/big")).body(big.clone()).send().await.expect("put");
    assert_eq!(r.status(), 413);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert_eq!(c.get(1, "big").await, None);
    // A client that sends the whole body before it reads reads the 413 (not a reset), and its
    // connection serves its next request, whether the body was announced too long or found too
    // long in chunks (a bulk body goes the same way).
    let mut raw = tokio::net::TcpStream::connect(c.api(1)).await.expect("connect");
    let chunked: String = big
        .as_bytes()
        .chunks(64 * 1024)
        .map(|c| format!("{:x}\r\n{}\r\n", c.len(), std::str::from_utf8(c).expect("text")))
        .collect();
    for (head, body) in [
        (format!("PUT /v1/kv/big HTTP/1.1\r\nhost: shoal\r\ncontent-length: {}\r\n\r\n", big.len()), big.clone()),
        ("PUT /v1/kv/big HTTP/1.1\r\nhost: shoal\r\ntransfer-encoding: chunked\r\n\r\n".into(), chunked + "0\r\n\r\n"),
    ] {
        let (status, problem) = exchange(&mut raw, &head, body.as_bytes()).await;
        assert_eq!(status, 413, "{head}{problem}");
        let (status, _) = exchange(&mut raw, "GET /v1/kv/big HTTP/1.1\r\nhost: shoal\r\n\r\n", b"").await;
        assert_eq!(status, 404, "after {head}");
    }

    for slot in 0..2 {
        let key = format!("cas{slot}");
        let put = |q: &str| c.http.put(c.url(1 - slot, &format!("/v1/kv/{key}{q}"))).body("v").send();
        assert_eq!(put("?cas=0").await.expect("put").status(), 200);
        let r = put("?cas=0").await.expect("put");
        assert_eq!(r.status(), 412);
        let version = r.json::<Value>().await.expect("problem")["current_version"].as_u64().expect("version");
        assert_eq!(put(&format!("?cas={}", version + 1)).await.expect("put").status(), 412);
        assert_eq!(put(&format!("?cas={version}")).await.expect("put").status(), 200);
        assert_eq!(put("?mode=add").await.expect("put").status(), 412);
        assert_eq!(put("?mode=replace").await.expect("put").status(), 200);
        // The same conditions as HTTP headers, and a GET that names the current ETag, through
        // either node.
        let etag = c.http.get(c.url(slot, &format!("/v1/kv/{key}"))).send().await.expect("get").headers()["etag"]
            .to_str()
            .expect("etag")
            .to_string();
        for via in 0..2 {
            let r = c.http.get(c.url(via, &format!("/v1/kv/{key}"))).header("if-none-match", &etag).send().await;
            let r = r.expect("get");
            assert_eq!((r.status().as_u16(), r.headers()["etag"].to_str().ok()), (304, Some(etag.as_str())));
        }
        let with = |name: &'static str, value: String| {
            c.http.put(c.url(1 - slot, &format!("/v1/kv/{key}"))).header(name, value).body("w").send()
        };
        let version: u64 = etag.trim_matches('"').parse().expect("version");
        assert_eq!(with("if-match", format!("\"{}\"", version + 1)).await.expect("put").status(), 412);
        assert_eq!(with("if-none-match", "*".into()).await.expect("put").status(), 412);
        assert_eq!(with("if-match", etag.clone()).await.expect("put").status(), 200);
        assert_eq!(c.get(slot, &key).await.as_deref(), Some("w"));
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_operations_hits_misses_and_forwards() {
    let cluster = TestCluster::start(2).await;
    let c = &cluster;
    c.wait_for_counts(&[500, 500]).await;
    let metrics = |slot: usize| async move {
        c.http.get(c.url(slot, "/metrics")).send().await.expect("metrics").text().await.expect("text")
    };
    let value = |text: &str, series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{series} missing from\n{text}"))
    };
    let before = metrics(0).await;
    for series in ["shoal_map_version ", "shoal_buckets_owned ", "shoal_is_leader ", "shoal_items "] {
        value(&before, series);
    }
    assert_eq!(value(&before, "shoal_buckets_owned "), 500.0);
    // Which build runs, and the leader changes seen (at least the first leader).
    let build = format!("shoal_build_info{{version=\"{}\",revision=\"{}\"}} ", shoal::VERSION, shoal::REVISION);
    assert_eq!(value(&before, &build), 1.0);
    assert!(value(&before, "shoal_raft_leader_changes_total ") >= 1.0);
    let view = c.json(1, "/v1/cluster").await;
    for m in view["members"].as_array().expect("members") {
        assert_eq!(
            (m["version"].as_str(), m["revision"].as_str()),
            (Some(shoal::VERSION), Some(shoal::REVISION)),
            "{m}"
        );
    }
    for i in 0..20 {
        c.put(0, &format!("m{i}"), "v").await;
        c.get(0, &format!("m{i}")).await;
        c.get(0, &format!("absent{i}")).await;
    }
    let (after0, after1) = (metrics(0).await, metrics(1).await);
    let ok = |t: &str, op: &str| value(t, &format!("shoal_operations_total{{op=\"{op}\",outcome=\"ok\"}}"));
    assert_eq!(ok(&after0, "put"), 20.0, "slot 0 answered every put, local or forwarded");
    assert!(value(&after0, "shoal_forwarded_operations_total ") > 0.0);
    let hits = value(&after0, "shoal_cache_hits_total ") + value(&after1, "shoal_cache_hits_total ");
    let misses = value(&after0, "shoal_cache_misses_total ") + value(&after1, "shoal_cache_misses_total ");
    assert_eq!((hits, misses), (20.0, 20.0), "every read is counted once, by the owner");
    let items = value(&after0, "shoal_items ") + value(&after1, "shoal_items ");
    assert_eq!(items, 20.0);
    assert!(after0.contains("shoal_operation_duration_seconds_bucket{op=\"get\",le=\"0.005\"}"));
    // Connections and bytes per listener: the test's client is connected to the client API
    // (its scrape included), the forwards went over the peer listener of slot 1, and the 20
    // values written through slot 0 are among the bytes it received.
    assert!(value(&after0, "shoal_connections{listener=\"client\"} ") >= 1.0);
    assert!(value(&after0, "shoal_connections_accepted_total{listener=\"client\"} ") >= 1.0);
    let received = |t: &str, l: &str| value(t, &format!("shoal_network_received_bytes_total{{listener=\"{l}\"}}"));
    let sent = |t: &str, l: &str| value(t, &format!("shoal_network_sent_bytes_total{{listener=\"{l}\"}}"));
    assert!(received(&after0, "client") > received(&before, "client") + 20.0 * 20.0);
    assert!(sent(&after0, "client") > sent(&before, "client"));
    assert!(received(&after1, "peer") > 0.0 && sent(&after1, "peer") > 0.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_operations_in_flight_together_each_get_their_own_answer() {
    let cluster = TestCluster::start(2).await;
    let c = &cluster;
    c.wait_for_counts(&[500, 500]).await;
    let map = c.json(0, "/v1/cluster/map").await;
    let owner_of_slot1 = json!(c.id(1));
    // Keys slot 1 owns, all sent to slot 0, 48 at a time: each is forwarded.
    let keys: Vec<String> = (0..)
        .map(|i| format!("fw:{i}"))
        .filter(|k| map["owners"][bucket_of(k.as_bytes()).0 as usize] == owner_of_slot1)
        .take(400)
        .collect();
    let each = || futures::stream::iter(keys.iter().enumerate());
    let puts: Vec<_> = each()
        .map(|(i, k)| async move { (i, c.put(0, k, &format!("value {i}")).await) })
        .buffer_unordered(48)
        .collect()
        .await;
    assert!(puts.iter().all(|(_, s)| *s == 200), "every forwarded write succeeded: {puts:?}");
    let gets: Vec<_> = each().map(|(i, k)| async move { (i, c.get(0, k).await) }).buffer_unordered(48).collect().await;
    for (i, got) in gets {
        assert_eq!(got, Some(format!("value {i}")), "{}", keys[i]);
    }
    let deletes: Vec<_> = each()
        .map(|(i, k)| async move {
            let url = c.url(0, &format!("/v1/kv/{k}"));
            let first = c.http.delete(&url).send().await.expect("delete").status().as_u16();
            let again = c.http.delete(&url).send().await.expect("delete").status().as_u16();
            (i, first, again)
        })
        .buffer_unordered(48)
        .collect()
        .await;
    assert!(deletes.iter().all(|&(_, first, again)| (first, again) == (204, 404)), "{deletes:?}");
    for k in keys.iter().step_by(37) {
        assert_eq!(c.get(0, k).await, None, "{k} was deleted");
    }
    // Every forwarded operation went on the peer link to the owner (no other way is left),
    // and answered as the owner's API does (the reads above, found and not found).
    let text = c.http.get(c.url(0, "/metrics")).send().await.expect("metrics").text().await.expect("text");
    let value = |series: &str| -> f64 {
        text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).expect(series)
    };
    let forwarded = value("shoal_forwarded_operations_total ");
    assert!(forwarded >= 1600.0, "{forwarded} forwarded");
    let on_links = |kind: &'static str| async move {
        let text = c.http.get(c.url(1, "/metrics")).send().await.expect("metrics").text().await.expect("text");
        let series = format!("shoal_peer_link_requests_total{{kind=\"{kind}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok()).expect("link requests counted")
    };
    let (reads, writes) = (on_links("reads").await, on_links("writes").await);
    assert!(reads + writes >= forwarded, "{reads} reads and {writes} writes on links for {forwarded} forwarded");
    // The other requests between nodes but Raft's are calls on links too: the cluster view asks
    // every member for its figures.
    let calls = on_links("calls").await;
    let view = c.http.get(c.url(0, "/v1/cluster")).send().await.expect("view");
    assert_eq!(view.status(), 200);
    assert!(on_links("calls").await > calls, "no call on a link");
    // Failures of forwarded writes keep the owner's status, code and current version.
    let before = on_links("writes").await;
    let key = &keys[1];
    let put = |q: String| c.http.put(c.url(0, &format!("/v1/kv/{key}{q}"))).body("w").send();
    let version = put(String::new()).await.expect("put").json::<Value>().await.expect("answer")["version"]
        .as_u64()
        .expect("version");
    let stale = put(format!("?cas={}", version + 1)).await.expect("put");
    assert_eq!(stale.status(), 412);
    let problem = stale.json::<Value>().await.expect("problem");
    assert_eq!(
        (problem["code"].as_str(), problem["current_version"].as_u64()),
        (Some("precondition_failed"), Some(version))
    );
    assert_eq!(put("?mode=add&ttl=5m&tags=a,b&priority=high".into()).await.expect("put").status(), 412);
    assert_eq!(put(format!("?cas={version}&ttl=5m&tags=a,b&priority=high")).await.expect("put").status(), 200);
    assert_eq!(c.get(0, key).await.as_deref(), Some("w"));
    let delete = || c.http.delete(c.url(0, &format!("/v1/kv/{key}"))).send();
    assert_eq!(delete().await.expect("delete").status(), 204);
    assert_eq!(delete().await.expect("delete").status(), 404);
    assert_eq!(on_links("writes").await, before + 6.0, "each write and delete above went over the link");
    // A bulk write and a bulk delete of the owner's keys through slot 0: one link write each,
    // with each key's own answer.
    let before = on_links("writes").await;
    // Every key is absent now: `cas: 0` (absent) holds, `cas: 99` does not.
    let items =
        [json!({"key": keys[0], "value": "bulk", "cas": 0}), json!({"key": keys[1], "value": "bulk", "cas": 99})]
            .into_iter()
            .chain([json!({"key": keys[2], "value": "bulk"})])
            .collect::<Vec<_>>();
    let put = c.post_json(0, "/v1/bulk/put", &json!({ "items": items })).await;
    let codes: Vec<&Value> = put["results"].as_array().expect("results").iter().map(|r| &r["error"]["code"]).collect();
    assert_eq!(codes, [&Value::Null, &json!("precondition_failed"), &Value::Null], "{put}");
    let deleted = c.post_json(0, "/v1/bulk/delete", &json!({"keys": [&keys[0], &keys[1], &keys[2]]})).await;
    let flags: Vec<&Value> = deleted["results"].as_array().expect("results").iter().map(|r| &r["deleted"]).collect();
    assert_eq!(flags, [&json!(true), &json!(false), &json!(true)], "{deleted}");
    assert_eq!(on_links("writes").await, before + 2.0, "each bulk request went over the link once");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_does_not_depend_on_the_node_asked() {
    let c = TestCluster::start(2).await;
    c.wait_for_counts(&[500, 500]).await;
    let map = c.json(0, "/v1/cluster/map").await;
    let owned_by = |slot: usize| {
        (0..)
            .map(|i| format!("expiring-{i}"))
            .find(|k| map["owners"][bucket_of(k.as_bytes()).0 as usize].as_u64() == Some(c.id(slot)))
            .expect("a key")
    };
    let key = owned_by(1);
    // The same options, through the owner (slot 1) and through the other node (slot 0).
    for (ttl, status) in [("36525d", 200), ("36526d", 400), ("1ns", 400), ("0", 400), ("90m", 200), ("1h30m", 400)] {
        for slot in [1, 0] {
            let r = c.http.put(c.url(slot, &format!("/v1/kv/{key}?ttl={ttl}"))).body("v").send().await.expect("put");
            assert_eq!(r.status().as_u16(), status, "ttl={ttl} via slot {slot}");
        }
    }
    // A forwarded ttl keeps its value: 1500 ms through the other node expires the key.
    let r = c.http.put(c.url(0, &format!("/v1/kv/{key}?ttl=1500ms"))).body("short").send().await.expect("put");
    assert_eq!(r.status(), 200);
    assert_eq!(c.get(1, &key).await.as_deref(), Some("short"));
    crate::harness::wait_for("the key to expire", || async { c.get(1, &key).await.is_none().then_some(()) }).await;
    // A bulk item's options travel the same way.
    let bulk = json!({"items": [{"key": key, "value": "b", "sliding": "36526d"}, {"key": owned_by(0), "value": "b", "sliding": "5m"}]});
    let r = c.http.post(c.url(0, "/v1/bulk/put")).json(&bulk).send().await.expect("bulk");
    let answer: Value = r.json().await.expect("json");
    assert_eq!(answer["results"][0]["error"]["code"], "bad_request", "{answer}");
    assert!(answer["results"][1]["error"].is_null(), "{answer}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_token_the_key_api_needs_it_and_forwards_carry_it() {
    const CLIENT: &str = "client-token-for-the-test";
    const ADMIN: &str = "admin-token-for-the-test";
    let c = TestCluster::start_with(3, |config| {
        config.client_token = Some(CLIENT.parse().expect("token"));
        config.admin_token = Some(ADMIN.parse().expect("token"));
    })
    .await;
    c.wait_for_counts(&[333, 333, 334]).await;
    // Without the token (or with a wrong one): 401 problem+json, nothing written.
    for auth in [None, Some("Bearer wrong"), Some(&format!("Basic {CLIENT}")[..])] {
        let mut r = c.http.put(c.url(0, "/v1/kv/refused")).body("v");
        if let Some(auth) = auth {
            r = r.header("authorization", auth);
        }
        let r = r.send().await.expect("put");
        assert_eq!(r.status(), 401, "{auth:?}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert_eq!(r.json::<Value>().await.expect("problem")["code"], "client_token_required");
    }
    let bearer = format!("Bearer {CLIENT}");
    let get = |slot: usize, key: String| {
        let request = c.http.get(c.url(slot, &format!("/v1/kv/{key}"))).header("authorization", &bearer);
        async move { request.send().await.expect("get").status().as_u16() }
    };
    assert_eq!(get(1, "refused".into()).await, 404, "the refused write did nothing");
    // With it: writes and reads through every node, most of them forwarded to the owner.
    for i in 0..30 {
        let r = c
            .http
            .put(c.url(i % 3, &format!("/v1/kv/t{i}")))
            .header("authorization", &bearer)
            .body("v")
            .send()
            .await
            .expect("put");
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        assert_eq!(get((i + 1) % 3, format!("t{i}")).await, 200);
    }
    let items: Vec<Value> = (0..30).map(|i| json!({"key": format!("b{i}"), "value": "v"})).collect();
    let r = c.http.post(c.url(1, "/v1/bulk/put")).header("authorization", &bearer).json(&json!({ "items": items }));
    let put: Value = r.send().await.expect("bulk").json().await.expect("json");
    assert!(put["results"].as_array().expect("results").iter().all(|r| r["error"].is_null()), "{put}");
    // A listing is broadcast to every member with the token: all of them answer.
    let r = c.http.get(c.url(2, "/v1/kv?prefix=t")).header("authorization", &bearer).send().await.expect("list");
    let list: Value = r.json().await.expect("json");
    assert_eq!((list["keys"].as_array().map(Vec::len), &list["incomplete"]), (Some(30), &json!(false)), "{list}");
    // The admin token opens the key API too; the cluster's reads stay open.
    let r = c.http.get(c.url(0, "/v1/kv/t1")).header("authorization", format!("Bearer {ADMIN}")).send().await;
    assert_eq!(r.expect("get").status(), 200);
    assert_eq!(c.http.get(c.url(0, "/v1/cluster")).send().await.expect("cluster").status(), 200);
    // The client library sends the client token to the key API.
    let client = shoal::client::Client::builder([c.api(0)]).client_token(CLIENT).connect().await.expect("connect");
    client.put("lib", &b"v"[..]).await.expect("put with the token");
    assert_eq!(client.get("lib").await.expect("get").map(|v| v.bytes), Some(bytes::Bytes::from_static(b"v")));
    let without = shoal::client::Client::connect([c.api(0)]).await.expect("connect");
    let refused = without.put("lib", &b"w"[..]).await.expect_err("no token");
    assert_eq!((refused.status(), refused.code()), (Some(401), Some("client_token_required")));
    // shoal bench carries it too, on its own connections and through the client library.
    for routing in ["direct", "client"] {
        let bench = |token: Option<&'static str>| {
            let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_shoal"));
            command.args(["bench", "--addr", &c.api(0), "--duration", "1s", "--keys", "300", "--connections", "2"]);
            command.args(["--ratio", "1:1", "--routing", routing, "-o", "json"]).env_remove("SHOAL_CLIENT_TOKEN");
            if let Some(token) = token {
                command.args(["--client-token", token]);
            }
            async move { command.output().await.expect("bench") }
        };
        let out = bench(Some(CLIENT)).await;
        assert!(out.status.success(), "{routing}: {}", String::from_utf8_lossy(&out.stderr));
        let report: Value = serde_json::from_slice(&out.stdout).expect("report");
        assert_eq!(report["errors"], json!({}), "{routing}: {report}");
        let refused = bench(None).await;
        let why = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && why.contains("client_token_required"), "{routing}: {why}");
    }
    c.shutdown().await;
}

/// Writes one request (`head` and `body`) on `stream`, then reads its answer: the status and the
/// body (by its `Content-Length`).
async fn exchange(stream: &mut tokio::net::TcpStream, head: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = std::time::Duration::from_secs(30);
    let io = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body).await?;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().expect("length"));
                if got.len() >= end + 4 + length {
                    let status = head[9..12].parse().expect("status");
                    return Ok::<_, std::io::Error>((
                        status,
                        String::from_utf8_lossy(&got[end + 4..end + 4 + length]).into_owned(),
                    ));
                }
            }
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(deadline, io).await.expect("answered in time").expect("the connection holds")
}
