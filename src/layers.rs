//! The top-level modules of `src/` form layers: no module imports, directly or through
//! others, one that imports it (`src/DESIGN.md`, "Layers"). Checked here on the source text,
//! so a change that closes a cycle fails a unit test, naming the cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file of `dir`, recursively.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules of `src/` and the files of each.
fn modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("read src") {
        let path = entry.expect("entry").path();
        let Some(name) = path.file_stem().and_then(|n| n.to_str()).map(str::to_owned) else { continue };
        if path.is_dir() {
            let mut files = Vec::new();
            sources(&path, &mut files);
            modules.insert(name, files);
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main" {
            modules.insert(name, vec![path]);
        }
    }
    modules
}

/// The modules a file's code (not its comments or test module) names through `crate::`.
fn imports(text: &str, names: &BTreeSet<String>) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
    let mut found = BTreeSet::new();
    for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for (at, _) in line.match_indices("crate::") {
            let rest = &line[at + "crate::".len()..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            if names.contains(&rest[..end]) {
                found.insert(rest[..end].to_owned());
            }
        }
    }
    found
}

/// A cycle in `graph` (its modules in order, the first again at the end), if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut found = path[start..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

/// Which top-level module imports which.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(src);
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    modules
        .iter()
        .map(|(name, files)| {
            let mut uses = BTreeSet::new();
            for file in files {
                let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
                if stem == "tests" || stem == "testing" {
                    continue;
                }
                uses.extend(imports(&std::fs::read_to_string(file).expect("read"), &names));
            }
            uses.remove(name);
            (name.clone(), uses)
        })
        .collect()
}

#[test]
fn no_top_level_module_imports_one_that_imports_it() {
    let graph = graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(graph.len() > 20, "the modules of src/ were found: {:?}", graph.keys());
    assert!(graph["node"].contains("transport"), "imports are found: {graph:?}");
    assert_eq!(cycle(&graph), None, "a cycle of top-level modules");
}

#[test]
fn a_cycle_is_found_and_named() {
    let edges = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")];
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in edges {
        graph.entry(from.into()).or_default().insert(to.into());
    }
    assert_eq!(cycle(&graph), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    graph.get_mut("c").map(|c| c.remove("a"));
    assert_eq!(cycle(&graph), None);
    let names = ["peer".to_owned(), "maintenance".to_owned()].into();
    let text = "use crate::peer::Peers;\n// crate::maintenance::X\nfn f() { crate::maintenance::y() }\n#[cfg(test)]\nmod tests { crate::peer }";
    assert_eq!(imports(text, &names), names);
    assert_eq!(imports("// crate::peer\n#[cfg(test)]\nmod tests { use crate::maintenance; }", &names), BTreeSet::new());
}
