//! `body_set_chunk` given a pointer into the current chunk (as a hook using
//! the FFI API directly can do) copies before it writes.

mod support;

use bytes::BytesMut;
use pier_lua::{RequestCtx, RouteHooks};
use support::*;

#[test]
fn body_set_chunk_from_a_pointer_into_the_chunk() {
    let e = engine(setup(RouteHooks {
        body_filter: src(
            "route t body_filter",
            r#"
            local base = require "pier.base"
            local api, ptr, len = base.api, base.ptr, base.len
            assert(api.body_chunk(ptr, len, base.int) == 0)
            local off = tonumber(pier.req.get_header("x-off"))
            -- The chunk's own bytes, shifted: source and destination overlap.
            assert(api.body_set_chunk(ptr[0] + off, len[0] - off) == 0)
            "#,
        ),
        ..Default::default()
    }));
    for (off, want) in [
        (0usize, "hello, overlapping world"),
        (2, "llo, overlapping world"),
    ] {
        let mut v = TestView::default();
        v.headers
            .push((b"x-off".to_vec(), off.to_string().into_bytes()));
        let mut chunk = BytesMut::from("hello, overlapping world");
        e.body_filter(0, &mut v, &mut RequestCtx::new(), &mut chunk, false)
            .unwrap();
        assert_eq!(&chunk[..], want.as_bytes(), "offset {off}");
    }
    // A large chunk, so a memcpy-based copy would take its vectorised path.
    let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut v = TestView::default();
    v.headers.push((b"x-off".to_vec(), b"7".to_vec()));
    let mut chunk = BytesMut::from(&big[..]);
    e.body_filter(0, &mut v, &mut RequestCtx::new(), &mut chunk, false)
        .unwrap();
    assert_eq!(&chunk[..], &big[7..]);
}
