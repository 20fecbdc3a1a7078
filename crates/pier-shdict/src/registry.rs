//! The dictionaries declared in the configuration, by name and by index.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use crate::SharedDict;

/// A configuration error building a [`Registry`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryError {
    /// A dictionary with an empty name.
    EmptyName,
    /// Two dictionaries with the same name.
    Duplicate(String),
    /// A dictionary with capacity 0.
    ZeroCapacity(String),
}

impl fmt::Display for RegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryError::EmptyName => f.write_str("shared dict with an empty name"),
            RegistryError::Duplicate(n) => write!(f, "shared dict \"{n}\" declared twice"),
            RegistryError::ZeroCapacity(n) => write!(f, "shared dict \"{n}\" has capacity 0"),
        }
    }
}

impl std::error::Error for RegistryError {}

/// All shared dictionaries of a configuration: `name -> Arc<SharedDict>`,
/// plus a dense `u32` index for the FFI layer (look the name up once, at
/// `pier.shared.NAME` access, then pass the index on every call).
///
/// Indexes follow declaration order and are stable for one `Registry`.
#[derive(Debug, Default)]
pub struct Registry {
    dicts: Vec<Arc<SharedDict>>,
    by_name: HashMap<Box<[u8]>, u32>,
}

impl Registry {
    /// Builds fresh, empty dictionaries from `(name, capacity_bytes)` pairs.
    pub fn new(specs: &[(&str, usize)]) -> Result<Self, RegistryError> {
        Self::build(specs, |_, _| None)
    }

    /// Builds the registry of a reloaded configuration, keeping the contents
    /// of every dictionary whose name and capacity are unchanged (as nginx
    /// keeps `lua_shared_dict` zones across a reload). Changed or new
    /// dictionaries start empty; dropped ones disappear when their last
    /// `Arc` does.
    pub fn reload(&self, specs: &[(&str, usize)]) -> Result<Self, RegistryError> {
        Self::build(specs, |name, cap| {
            self.get(name)
                .filter(|d| d.capacity() == cap)
                .map(Arc::clone)
        })
    }

    fn build(
        specs: &[(&str, usize)],
        mut reuse: impl FnMut(&str, usize) -> Option<Arc<SharedDict>>,
    ) -> Result<Self, RegistryError> {
        let mut reg = Registry {
            dicts: Vec::with_capacity(specs.len()),
            by_name: HashMap::with_capacity(specs.len()),
        };
        for &(name, cap) in specs {
            if name.is_empty() {
                return Err(RegistryError::EmptyName);
            }
            if cap == 0 {
                return Err(RegistryError::ZeroCapacity(name.to_owned()));
            }
            if reg.by_name.contains_key(name.as_bytes()) {
                return Err(RegistryError::Duplicate(name.to_owned()));
            }
            let dict = reuse(name, cap).unwrap_or_else(|| Arc::new(SharedDict::new(name, cap)));
            let idx = u32::try_from(reg.dicts.len()).expect("fewer than 2^32 dicts");
            reg.by_name.insert(name.as_bytes().into(), idx);
            reg.dicts.push(dict);
        }
        Ok(reg)
    }

    /// The dictionary called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<SharedDict>> {
        self.index_of(name).and_then(|i| self.by_index(i))
    }

    /// The index of the dictionary called `name`.
    pub fn index_of(&self, name: &str) -> Option<u32> {
        self.index_of_bytes(name.as_bytes())
    }

    /// [`index_of`](Self::index_of) for a name given as raw bytes (from FFI).
    pub fn index_of_bytes(&self, name: &[u8]) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// The dictionary at `index`.
    #[inline]
    pub fn by_index(&self, index: u32) -> Option<&Arc<SharedDict>> {
        self.dicts.get(index as usize)
    }

    /// Number of dictionaries.
    pub fn len(&self) -> usize {
        self.dicts.len()
    }

    /// Whether no dictionary is declared.
    pub fn is_empty(&self) -> bool {
        self.dicts.is_empty()
    }

    /// The dictionaries in index order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<SharedDict>> {
        self.dicts.iter()
    }
}
