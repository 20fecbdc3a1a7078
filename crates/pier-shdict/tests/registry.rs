//! The registry of configured dictionaries.

use std::sync::Arc;

use pier_shdict::{Registry, RegistryError, Value};

#[test]
fn lookup_by_name_and_index() {
    let r = Registry::new(&[("limits", 1 << 20), ("cache", 64 * 1024)]).unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r.index_of("limits"), Some(0));
    assert_eq!(r.index_of("cache"), Some(1));
    assert_eq!(r.index_of_bytes(b"cache"), Some(1));
    assert_eq!(r.index_of("nope"), None);
    assert_eq!(r.by_index(1).unwrap().name(), "cache");
    assert!(r.by_index(2).is_none());
    let d = r.get("limits").unwrap();
    assert_eq!(d.capacity(), 1 << 20);
    assert!(Arc::ptr_eq(d, r.by_index(0).unwrap()));
    let names: Vec<&str> = r.iter().map(|d| d.name()).collect();
    assert_eq!(names, ["limits", "cache"]);
}

#[test]
fn rejects_bad_specs() {
    assert_eq!(
        Registry::new(&[("a", 10), ("a", 20)]).unwrap_err(),
        RegistryError::Duplicate("a".into())
    );
    assert_eq!(
        Registry::new(&[("", 10)]).unwrap_err(),
        RegistryError::EmptyName
    );
    assert_eq!(
        Registry::new(&[("z", 0)]).unwrap_err(),
        RegistryError::ZeroCapacity("z".into())
    );
    assert_eq!(
        RegistryError::Duplicate("a".into()).to_string(),
        "shared dict \"a\" declared twice"
    );
    assert!(Registry::new(&[]).unwrap().is_empty());
}

#[test]
fn reload_keeps_unchanged_dicts() {
    let r = Registry::new(&[("keep", 4096), ("resize", 4096), ("drop", 4096)]).unwrap();
    for d in r.iter() {
        d.set(b"k", Value::Number(1.0), 0, 0, 0);
    }
    let r2 = r
        .reload(&[("new", 4096), ("resize", 8192), ("keep", 4096)])
        .unwrap();
    assert_eq!(r2.index_of("keep"), Some(2));
    assert!(Arc::ptr_eq(r.get("keep").unwrap(), r2.get("keep").unwrap()));
    assert!(r2
        .get("keep")
        .unwrap()
        .get(b"k", 0, &mut Vec::new())
        .is_some());
    assert!(r2.get("resize").unwrap().is_empty());
    assert_eq!(r2.get("resize").unwrap().capacity(), 8192);
    assert!(r2.get("new").unwrap().is_empty());
    assert!(r2.get("drop").is_none());
    assert!(r.reload(&[("x", 1), ("x", 1)]).is_err());
}
