//! HTTP/1 for Pier: heads with fixed-slot header maps (`headers`, `known`),
//! the parser and its anti-smuggling checks (`head`), the validating chunked
//! scanner (`chunked`), whole-body decoding for clients (`body`), head serialisation (`write`) and the cached `Date`
//! (`date`). Parsing is httparse's; what is Pier's own is the zero-allocation
//! header storage and the framing policy.
#![forbid(unsafe_code)]

pub mod body;
pub mod canon;
pub mod chunked;
pub mod date;
pub mod head;
pub mod headers;
pub mod known;
pub mod url;
pub mod write;

pub use body::BodyDecoder;
pub use canon::{EscapedSlashes, PathPolicy};
pub use chunked::ChunkedScanner;
pub use head::{
    hop_by_hop, is_tchar, remove_hop_by_hop, valid_field_name, valid_field_value, BodyLen,
    HeadLimits, Method, RequestHead, ResponseHead,
};
pub use headers::Headers;
