//! How inode ids map to tables on a member: the cluster's tables at start, cut finer by
//! every split this server makes or sees in a map. Ranges only ever get finer, so a map
//! that lags behind a split here cannot merge the halves back.

use kochab_proto::InodeId;
use kochab_proto::cluster::TableId;

/// Sorted, disjoint id ranges `(lo, hi)`; each is the table `TableId(lo)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    /// The tables `ranges` (`(lo, hi)`, disjoint, in any order).
    pub fn new(mut ranges: Vec<(u64, u64)>) -> Ranges {
        ranges.sort_unstable();
        Ranges(ranges)
    }

    /// The ranges, sorted by `lo`.
    pub fn as_slice(&self) -> &[(u64, u64)] {
        &self.0
    }

    /// The table that holds `id`.
    pub fn table_of(&self, id: InodeId) -> Option<TableId> {
        let r = &self.0;
        let i = r.partition_point(|&(lo, _)| lo <= id);
        (i > 0 && id < r[i - 1].1).then(|| TableId(r[i - 1].0))
    }

    /// The tables of `ids`, each once, in the order the ids first name them (the first is
    /// the one a client routed by). `Err`: an id no table holds.
    pub fn tables_of(
        &self,
        ids: impl IntoIterator<Item = InodeId>,
    ) -> Result<Vec<TableId>, InodeId> {
        let mut tables = Vec::new();
        for id in ids {
            let t = self.table_of(id).ok_or(id)?;
            if !tables.contains(&t) {
                tables.push(t);
            }
        }
        Ok(tables)
    }

    /// Cuts the ranges so that each of `tables` (`(lo, hi)`, from a map or a split)
    /// starts and ends a range, where it lies inside one.
    pub fn cut(&mut self, tables: impl IntoIterator<Item = (u64, u64)>) {
        let r = &mut self.0;
        for (lo, hi) in tables {
            for point in [lo, hi] {
                let i = r.partition_point(|x| x.0 <= point);
                if i > 0 && r[i - 1].0 < point && point < r[i - 1].1 {
                    let end = r[i - 1].1;
                    r[i - 1].1 = point;
                    r.insert(i, (point, end));
                }
            }
        }
    }

    /// Records splits `(table, at)`: ids from `at` on belong to the new table `at`. A
    /// table not known here is skipped (its split arrives with the map).
    pub fn split(&mut self, splits: impl IntoIterator<Item = (u64, u64)>) {
        for (lo, at) in splits {
            let Some(&(_, hi)) = self.0.iter().find(|r| r.0 == lo) else {
                continue;
            };
            self.cut([(lo, at), (at, hi)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_to_the_table_whose_range_holds_them() {
        let r = Ranges::new(vec![(50, 60), (10, 20), (20, 30)]);
        assert_eq!(r.table_of(9), None);
        assert_eq!(r.table_of(10), Some(TableId(10)));
        assert_eq!(r.table_of(29), Some(TableId(20)));
        assert_eq!(r.table_of(30), None, "a gap between tables");
        assert_eq!(r.table_of(55), Some(TableId(50)));
        assert_eq!(r.table_of(u64::MAX), None);
        assert_eq!(Ranges::default().table_of(0), None);
    }

    #[test]
    fn cuts_and_splits_only_make_ranges_finer() {
        let mut r = Ranges::new(vec![(0, 100), (100, 200)]);
        r.cut([(40, 60)]);
        assert_eq!(r.as_slice(), &[(0, 40), (40, 60), (60, 100), (100, 200)]);
        // A map that still shows the table whole merges nothing back.
        r.cut([(0, 100)]);
        assert_eq!(r.as_slice().len(), 4);
        // A cut outside every range, or on a boundary, changes nothing.
        r.cut([(300, 400), (100, 200)]);
        assert_eq!(r.as_slice().len(), 4);
        r.split([(100, 150), (777, 800)]);
        assert_eq!(
            r.as_slice(),
            &[(0, 40), (40, 60), (60, 100), (100, 150), (150, 200)]
        );
        assert_eq!(r.table_of(160), Some(TableId(150)));
    }
}
