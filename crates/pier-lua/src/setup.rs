//! What the proxy hands to every engine: the hook sources of one config load.

use std::path::PathBuf;

use crate::phase::Phase;

/// Lua code: inline in the config, or a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `name` is the chunk name errors show, e.g. `route api access`.
    Inline {
        code: String,
        name: String,
    },
    File(PathBuf),
}

impl Source {
    /// The code and the chunk name (`=name` shows verbatim, `@path` as a file).
    pub(crate) fn load(&self) -> Result<(String, String), String> {
        match self {
            Source::Inline { code, name } => Ok((code.clone(), format!("={name}"))),
            Source::File(path) => match std::fs::read_to_string(path) {
                Ok(code) => Ok((code, format!("@{}", path.display()))),
                Err(e) => Err(format!("{}: {e}", path.display())),
            },
        }
    }
}

/// The hooks of one route (index = the proxy's route index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteHooks {
    pub access: Option<Source>,
    pub content: Option<Source>,
    pub balancer: Option<Source>,
    pub upstream_request: Option<Source>,
    pub header_filter: Option<Source>,
    pub body_filter: Option<Source>,
    pub log: Option<Source>,
}

impl RouteHooks {
    /// The hook for a route phase (`None` for `Init`, `InitWorker`, `Timer`).
    pub fn get(&self, phase: Phase) -> Option<&Source> {
        match phase {
            Phase::Access => self.access.as_ref(),
            Phase::Content => self.content.as_ref(),
            Phase::Balancer => self.balancer.as_ref(),
            Phase::UpstreamRequest => self.upstream_request.as_ref(),
            Phase::HeaderFilter => self.header_filter.as_ref(),
            Phase::BodyFilter => self.body_filter.as_ref(),
            Phase::Log => self.log.as_ref(),
            Phase::Init | Phase::InitWorker | Phase::Timer => None,
        }
    }
}

/// Everything Lua for one config load. `Send + Sync`: built once, shared by
/// all worker threads as `Arc<LuaSetup>`, each making its own [`crate::LuaEngine`].
#[derive(Debug, Clone, Default)]
pub struct LuaSetup {
    /// Runs first in every Lua state (once per worker thread per load):
    /// define shared functions/globals here; seed shared dicts with `add`.
    pub init: Option<Source>,
    /// Runs in every Lua state after `init`; may start timers.
    pub init_worker: Option<Source>,
    /// Per route, by the proxy's route index.
    pub routes: Vec<RouteHooks>,
    /// `(name, capacity bytes)`: what the proxy builds the
    /// `pier_shdict::Registry` from (listed here for `pier check`).
    pub shared_dicts: Vec<(String, usize)>,
    /// Bytes of Lua heap per state (0 = unlimited).
    pub memory_limit: usize,
    /// Extra `package.path` entries (e.g. `/etc/pier/lua/?.lua`).
    pub package_path: Vec<String>,
}

impl LuaSetup {
    /// Every source with where it is used (`"init"`, `"route 2 access"`).
    pub(crate) fn sources(&self) -> impl Iterator<Item = (String, &Source)> {
        let global = [("init", &self.init), ("init_worker", &self.init_worker)]
            .into_iter()
            .filter_map(|(n, s)| s.as_ref().map(|s| (n.to_owned(), s)));
        let routes = self.routes.iter().enumerate().flat_map(|(i, r)| {
            Phase::ROUTE
                .into_iter()
                .filter_map(move |p| r.get(p).map(|s| (format!("route {i} {p}"), s)))
        });
        global.chain(routes)
    }

    /// The shared dictionaries of this setup. With `previous` (a reload),
    /// dictionaries whose name and capacity are unchanged keep their
    /// contents (as nginx keeps `lua_shared_dict` zones).
    pub fn build_registry(
        &self,
        previous: Option<&pier_shdict::Registry>,
    ) -> Result<pier_shdict::Registry, pier_shdict::RegistryError> {
        let specs: Vec<(&str, usize)> = self
            .shared_dicts
            .iter()
            .map(|(n, c)| (n.as_str(), *c))
            .collect();
        match previous {
            Some(old) => old.reload(&specs),
            None => pier_shdict::Registry::new(&specs),
        }
    }

    /// Compiles every chunk in a scratch state (no code runs): for
    /// `pier check` and before swapping in a reloaded config.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let lua = mlua::Lua::new();
        let mut errors = Vec::new();
        for (what, src) in self.sources() {
            match src.load() {
                Ok((code, name)) => {
                    if let Err(e) = lua.load(code).set_name(name).into_function() {
                        errors.push(format!("{what}: {}", crate::error::describe(&e)));
                    }
                }
                Err(e) => errors.push(format!("{what}: {e}")),
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (name, cap) in &self.shared_dicts {
            if name.is_empty() || *cap == 0 || !seen.insert(name) {
                errors.push(format!(
                    "shared dict \"{name}\": empty name, zero capacity or declared twice"
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}
