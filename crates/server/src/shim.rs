//! TEMPORARY: the engine and store APIs of issue 31 as the plan states them, until the
//! branches that provide them are merged (then this module goes).
#![allow(dead_code, unused_variables)]

use kochab_meta::engine::OpResult;
use kochab_meta::{Engine, Mutation};
use kochab_proto::layout::SliceRef;
use kochab_proto::{Attr, Credentials, InodeId, TimeNs};
use std::time::Duration;

pub trait EngineLayout {
    fn layout(&self, id: InodeId, chunks: std::ops::Range<u64>) -> Vec<(u64, Vec<SliceRef>)>;
    fn chunk_refs(&self, id: InodeId, chunk: u64) -> &[SliceRef];
    fn commit_slices(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        slices: &[(u64, SliceRef)],
        end: u64,
        now: TimeNs,
    ) -> OpResult<(Vec<Mutation>, Attr, Vec<u64>)>;
    fn replace_chunk(
        &mut self,
        id: InodeId,
        chunk: u64,
        expected: &[SliceRef],
        new: Vec<SliceRef>,
    ) -> OpResult<(Vec<Mutation>, Vec<u64>)>;
    fn take_freed_objects(&mut self) -> Vec<(InodeId, u64, u64)>;
}

impl EngineLayout for Engine {
    fn layout(&self, id: InodeId, chunks: std::ops::Range<u64>) -> Vec<(u64, Vec<SliceRef>)> {
        unimplemented!()
    }
    fn chunk_refs(&self, id: InodeId, chunk: u64) -> &[SliceRef] {
        unimplemented!()
    }
    fn commit_slices(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        slices: &[(u64, SliceRef)],
        end: u64,
        now: TimeNs,
    ) -> OpResult<(Vec<Mutation>, Attr, Vec<u64>)> {
        unimplemented!()
    }
    fn replace_chunk(
        &mut self,
        id: InodeId,
        chunk: u64,
        expected: &[SliceRef],
        new: Vec<SliceRef>,
    ) -> OpResult<(Vec<Mutation>, Vec<u64>)> {
        unimplemented!()
    }
    fn take_freed_objects(&mut self) -> Vec<(InodeId, u64, u64)> {
        Vec::new()
    }
}

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
