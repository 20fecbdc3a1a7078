//! CORS for a route with `[route.cors]`: preflights answered from config,
//! and the CORS fields of the route's responses.

use crate::phases::LocalResponse;
use crate::session::Session;
use crate::state::State;
use pier_http::ResponseHead;

/// A CORS preflight (OPTIONS with Origin and Access-Control-Request-Method)
/// answered from the route's `[route.cors]`: 204 with the allowed origin,
/// methods and headers; a disallowed origin gets 403.
pub(crate) fn preflight(
    cors: &pier_config::Cors,
    req: &pier_http::RequestHead,
) -> Option<LocalResponse> {
    if req.method_kind() != pier_http::Method::Options {
        return None;
    }
    let origin = req.headers.get(b"origin")?;
    req.headers.get(b"access-control-request-method")?;
    let Some(allow) = allowed_origin(cors, origin) else {
        return Some(LocalResponse {
            status: 403,
            headers: Vec::new(),
            body: b"CORS origin not allowed\n".to_vec(),
            reason: "cors-origin",
            kind: None,
        });
    };
    let mut headers = vec![
        (b"Access-Control-Allow-Origin".to_vec(), allow),
        (
            b"Access-Control-Allow-Methods".to_vec(),
            cors.allow_methods.join(", ").into_bytes(),
        ),
        (
            b"Access-Control-Allow-Headers".to_vec(),
            cors.allow_headers.join(", ").into_bytes(),
        ),
        (
            b"Access-Control-Max-Age".to_vec(),
            cors.max_age.as_secs().to_string().into_bytes(),
        ),
        (b"Vary".to_vec(), b"Origin".to_vec()),
    ];
    if !cors.expose_headers.is_empty() {
        headers.push((
            b"Access-Control-Expose-Headers".to_vec(),
            cors.expose_headers.join(", ").into_bytes(),
        ));
    }
    if cors.allow_credentials {
        headers.push((
            b"Access-Control-Allow-Credentials".to_vec(),
            b"true".to_vec(),
        ));
    }
    Some(LocalResponse {
        status: 204,
        headers,
        body: Vec::new(),
        reason: "cors-preflight",
        kind: None,
    })
}

/// The Access-Control-Allow-Origin value for `origin`, if it is allowed.
fn allowed_origin(cors: &pier_config::Cors, origin: &[u8]) -> Option<Vec<u8>> {
    if cors.allow_origins.iter().any(|o| o == "*") && !cors.allow_credentials {
        return Some(b"*".to_vec());
    }
    cors.allow_origins
        .iter()
        .any(|o| o.as_bytes().eq_ignore_ascii_case(origin))
        .then(|| origin.to_vec())
}

/// CORS fields on an actual response of a `[route.cors]` route.
pub(crate) fn apply(state: &State, sess: &Session, resp: &mut ResponseHead) {
    let Some(cors) = sess.route.and_then(|r| state.cfg.routes[r].cors.as_ref()) else {
        return;
    };
    let Some(origin) = sess.req.headers.get(b"origin") else {
        return;
    };
    let Some(allow) = allowed_origin(cors, origin) else {
        return;
    };
    resp.headers.insert(b"Access-Control-Allow-Origin", &allow);
    if allow != b"*" {
        resp.headers.append(b"Vary", b"Origin");
    }
    if !cors.expose_headers.is_empty() {
        resp.headers.insert(
            b"Access-Control-Expose-Headers",
            cors.expose_headers.join(", ").as_bytes(),
        );
    }
    if cors.allow_credentials {
        resp.headers
            .insert(b"Access-Control-Allow-Credentials", b"true");
    }
}
