//! TEMPORARY: the engine and store APIs of issue 31 as the plan states them, until the
//! branches that provide them are merged (then this module goes).
#![allow(dead_code, unused_variables)]

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presign {
    Get,
    PutCreate,
}

pub trait StorePresign {
    fn presign(&self, name: &str, how: Presign, expires_in: Duration) -> Option<String>;
}

impl<T: kochab_store::ObjectStore + ?Sized> StorePresign for T {
    fn presign(&self, name: &str, how: Presign, expires_in: Duration) -> Option<String> {
        None
    }
}
