//! Purges and bans: what the admin API (`/api/cache/purge`), a purge from
//! another node of the fleet, and Lua's `pier.cache.purge` apply, one
//! code for all three (docs/cache.md "Purge and tags").

use crate::state::State;

/// Purges `asks` from `zone` (or every zone): the objects removed, or the
/// status and reason of a refusal (nothing is purged then).
pub fn apply(
    state: &State,
    zone: Option<&str>,
    asks: &[(String, String)],
) -> Result<usize, (&'static str, String)> {
    let zones: Vec<&std::sync::Arc<pier_cache::Zone>> = state
        .cache_zones
        .iter()
        .filter(|z| zone.is_none_or(|n| z.name == n))
        .collect();
    if zones.is_empty() {
        return Err(("404 Not Found", "no such cache zone".into()));
    }
    // Every ask is checked before any is applied.
    let mut keys = Vec::with_capacity(asks.len());
    for (what, v) in asks {
        if !matches!(what.as_str(), "url" | "prefix" | "tag" | "key" | "ban") {
            return Err((
                "400 Bad Request",
                format!("{what:?}: url, prefix, tag, key or ban"),
            ));
        }
        if v.is_empty() {
            return Err(("400 Bad Request", format!("empty {what}")));
        }
        keys.push(match what.as_str() {
            "url" => match crate::cache_key::url_keys(state, v) {
                Ok(k) => Purging::Key(k),
                Err(e) => return Err(("400 Bad Request", e.to_string())),
            },
            "ban" => match ban_regex(v) {
                Ok(re) => Purging::Ban(re),
                Err(e) => return Err(("400 Bad Request", e)),
            },
            _ => Purging::Plain,
        });
    }
    let mut purged = 0usize;
    for ((what, v), url_key) in asks.iter().zip(keys) {
        for z in &zones {
            purged += match (what.as_str(), &url_key) {
                ("url", Purging::Key(k)) => {
                    let mut ext = k.to_vec();
                    ext.push(b'\n');
                    usize::from(z.invalidate(k)) + z.purge_prefix(&ext)
                }
                ("ban", Purging::Ban(re)) => z.purge_where(|k| re.is_match(k)),
                ("prefix", _) => z.purge_prefix(v.as_bytes()),
                ("tag", _) => z.purge_tag(v.as_bytes()),
                _ => usize::from(z.invalidate(v.as_bytes())),
            };
        }
    }
    Ok(purged)
}

/// What an ask needs beyond its text, checked before anything is purged.
enum Purging {
    Plain,
    /// A URL's cache key.
    Key(Vec<u8>),
    /// A ban's expression.
    Ban(regex::bytes::Regex),
}

/// A ban: a regular expression over cache keys (`http://host/path?query`,
/// then any `\n`-joined extra parts), as Varnish's `ban req.url ~ ...`
/// but applied at once. Bounded: it comes from the admin API or from
/// another node over Redis.
fn ban_regex(v: &str) -> Result<regex::bytes::Regex, String> {
    if v.len() > 1024 {
        return Err("ban: at most 1024 bytes".into());
    }
    regex::bytes::RegexBuilder::new(v)
        .size_limit(1 << 20)
        .dfa_size_limit(1 << 20)
        .build()
        .map_err(|e| format!("ban: {e}"))
}
