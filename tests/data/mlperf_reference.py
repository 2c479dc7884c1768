# Vendored from mlcommons/training (https://github.com/mlcommons/training), commit
# aa344c7fb900e82ed19fb94aebfed50c63ab2204, recommendation_v2/torchrec_dlrm/:
#   multi_hot.py                                       (class Multihot)
#   scripts/materialize_synthetic_multihot_dataset.py  (main's per-day loop)
#   data/multi_hot_criteo.py                           (class MultiHotCriteoIterDataPipe)
#
# The repository is licensed under the Apache License, Version 2.0 (its LICENSE.md); you may
# not use this file except in compliance with the License. You may obtain a copy at
#     http://www.apache.org/licenses/LICENSE-2.0
# Unless required by applicable law or agreed to in writing, software distributed under the
# License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND.
# The three files themselves carry this header:
#
#   Copyright (c) Meta Platforms, Inc. and affiliates.
#
#   This source code is licensed under the MIT license found in the
#   LICENSE file in the root directory of this source tree.
#
# Only what the tests call is kept, otherwise verbatim but for line breaks (ruff format).
# Adapted (and nothing else):
# - Multihot: the frequency-statistics members (collect_freqs_stats, save_freqs_stats,
#   pause_stats_collection_during_val_and_test) are left out (they only count ids).
# - materialize: the script's argparse and torch.distributed set-up (init_process_group,
#   rank/world_size over DAYS) are left out; ``materialize_day`` is the body of its loop for
#   one day, with the same arguments it uses.
# - MultiHotCriteoIterDataPipe: the iopath PathManager (unused for local files) is left out,
#   and ``np.lib.format._read_array_header`` (removed in numpy 2) is replaced by the public
#   read_array_header_1_0 / _2_0 it dispatched to. The unimplemented shuffled-training branch
#   is left out. ``hashes`` is not used by the reader (as upstream).
# Nothing here needs a GPU. Not part of dlrm_vrgd: test-only, for comparison.
# ruff: noqa

import os
import shutil
import zipfile
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torch.utils.data import IterableDataset
from pyre_extensions import none_throws


# ------------------------------------------------------------------ multi_hot.py: Multihot
class Multihot:
    def __init__(
        self,
        multi_hot_sizes: List[int],
        num_embeddings_per_feature: List[int],
        batch_size: int,
        collect_freqs_stats: bool,
        dist_type: str = "uniform",
    ):
        if dist_type not in {"uniform", "pareto"}:
            raise ValueError(
                "Multi-hot distribution type {} is not supported."
                'Only "uniform" and "pareto" are supported.'.format(dist_type)
            )
        self.dist_type = dist_type
        self.multi_hot_sizes = multi_hot_sizes
        self.num_embeddings_per_feature = num_embeddings_per_feature
        self.batch_size = batch_size

        # Generate 1-hot to multi-hot lookup tables, one lookup table per sparse embedding table.
        self.multi_hot_tables_l = self.__make_multi_hot_indices_tables(
            dist_type, multi_hot_sizes, num_embeddings_per_feature
        )

        # Pooling offsets are computed once and reused.
        self.offsets = self.__make_offsets(multi_hot_sizes, num_embeddings_per_feature, batch_size)
        self.collect_freqs_stats = collect_freqs_stats

    def __make_multi_hot_indices_tables(
        self,
        dist_type: str,
        multi_hot_sizes: List[int],
        num_embeddings_per_feature: List[int],
    ) -> List[np.array]:
        np.random.seed(0)  # The seed is necessary for all ranks to produce the same lookup values.
        multi_hot_tables_l = []
        for embs_count, multi_hot_size in zip(num_embeddings_per_feature, multi_hot_sizes):
            embedding_ids = np.arange(embs_count)[:, np.newaxis]
            if dist_type == "uniform":
                synthetic_sparse_ids = np.random.randint(
                    0, embs_count, size=(embs_count, multi_hot_size - 1)
                )
            elif dist_type == "pareto":
                synthetic_sparse_ids = (
                    np.random.pareto(a=0.25, size=(embs_count, multi_hot_size - 1)).astype(np.int32)
                    % embs_count
                )
            multi_hot_table = np.concatenate((embedding_ids, synthetic_sparse_ids), axis=-1)
            multi_hot_tables_l.append(multi_hot_table)
        multi_hot_tables_l = [
            torch.from_numpy(multi_hot_table).int() for multi_hot_table in multi_hot_tables_l
        ]
        return multi_hot_tables_l

    def __make_offsets(
        self,
        multi_hot_sizes: int,
        num_embeddings_per_feature: List[int],
        batch_size: int,
    ) -> List[torch.Tensor]:
        lS_o = torch.ones((len(num_embeddings_per_feature) * batch_size), dtype=torch.int32)
        for k, multi_hot_size in enumerate(multi_hot_sizes):
            lS_o[k * batch_size : (k + 1) * batch_size] = multi_hot_size
        lS_o = torch.cumsum(torch.concat((torch.tensor([0]), lS_o)), axis=0)
        return lS_o

    def __make_new_batch(
        self,
        lS_i: torch.Tensor,
        batch_size: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        lS_i = lS_i.reshape(-1, batch_size)
        multi_hot_ids_l = []
        for k, (sparse_data_batch_for_table, multi_hot_table) in enumerate(
            zip(lS_i, self.multi_hot_tables_l)
        ):
            multi_hot_ids = torch.nn.functional.embedding(
                sparse_data_batch_for_table, multi_hot_table
            )
            multi_hot_ids = multi_hot_ids.reshape(-1)
            multi_hot_ids_l.append(multi_hot_ids)
        lS_i = torch.cat(multi_hot_ids_l)
        if batch_size == self.batch_size:
            return lS_i, self.offsets
        else:
            return lS_i, self.__make_offsets(
                self.multi_hot_sizes, self.num_embeddings_per_feature, batch_size
            )

    def convert_to_multi_hot(self, batch: Batch) -> Batch:
        batch_size = len(batch.dense_features)
        lS_i = batch.sparse_features._values
        lS_i, lS_o = self.__make_new_batch(lS_i, batch_size)
        new_sparse_features = KeyedJaggedTensor.from_offsets_sync(
            keys=batch.sparse_features._keys,
            values=lS_i,
            offsets=lS_o,
        )
        return Batch(
            dense_features=batch.dense_features,
            sparse_features=new_sparse_features,
            labels=batch.labels,
        )


# ------------------------------------- scripts/materialize_synthetic_multihot_dataset.py
def materialize_day(
    i: int,
    in_memory_binary_criteo_path: str,
    output_path: str,
    multihot: Multihot,
    num_embeddings_per_feature: List[int],
    copy_labels_and_dense: bool = True,
) -> None:
    """The body of main()'s ``for i in range(rank, DAYS, world_size)`` loop."""
    input_file_path = os.path.join(in_memory_binary_criteo_path, f"day_{i}_sparse.npy")
    sparse_data = np.load(input_file_path, mmap_mode="r")
    multi_hot_ids_dict = {}
    for j, (multi_hot_table, hash) in enumerate(
        zip(multihot.multi_hot_tables_l, num_embeddings_per_feature)
    ):
        sparse_tensor = torch.from_numpy(sparse_data[:, j] % hash)
        multi_hot_ids_dict[str(j)] = nn.functional.embedding(sparse_tensor, multi_hot_table).numpy()
    output_file_path = os.path.join(output_path, f"day_{i}_sparse_multi_hot.npz")
    np.savez(output_file_path, **multi_hot_ids_dict)
    if copy_labels_and_dense:
        for part in ["labels", "dense"]:
            source_path = os.path.join(in_memory_binary_criteo_path, f"day_{i}_{part}.npy")
            out_path = os.path.join(output_path, f"day_{i}_{part}.npy")
            shutil.copyfile(source_path, out_path)


# ---------------------------------------- data/multi_hot_criteo.py: MultiHotCriteoIterDataPipe
class MultiHotCriteoIterDataPipe(IterableDataset):
    def __init__(
        self,
        stage: str,
        dense_paths: List[str],
        sparse_paths: List[str],
        labels_paths: List[str],
        batch_size: int,
        rank: int,
        world_size: int,
        drop_last: Optional[bool] = False,
        shuffle_batches: bool = False,
        shuffle_training_set: bool = False,
        shuffle_training_set_random_seed: int = 0,
        mmap_mode: bool = False,
        hashes: Optional[List[int]] = None,
    ) -> None:
        self.stage = stage
        self.dense_paths = dense_paths
        self.sparse_paths = sparse_paths
        self.labels_paths = labels_paths
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.shuffle_batches = shuffle_batches
        self.shuffle_training_set = shuffle_training_set
        np.random.seed(shuffle_training_set_random_seed)
        self.mmap_mode = mmap_mode
        self.hashes: np.ndarray = np.array(hashes).reshape((CAT_FEATURE_COUNT, 1))

        m = "r" if mmap_mode else None
        self.dense_arrs: List[np.ndarray] = [np.load(f, mmap_mode=m) for f in self.dense_paths]
        self.labels_arrs: List[np.ndarray] = [np.load(f, mmap_mode=m) for f in self.labels_paths]
        self.sparse_arrs: List = []
        for sparse_path in self.sparse_paths:
            multi_hot_ids_l = []
            for feat_id_num in range(CAT_FEATURE_COUNT):
                multi_hot_ft_ids = self._load_from_npz(sparse_path, f"{feat_id_num}.npy")
                multi_hot_ids_l.append(multi_hot_ft_ids)
            self.sparse_arrs.append(multi_hot_ids_l)
        len_d0 = len(self.dense_arrs[0])
        second_half_start_index = int(len_d0 // 2 + len_d0 % 2)
        if stage == "val":
            self.dense_arrs[0] = self.dense_arrs[0][:second_half_start_index, :]
            self.labels_arrs[0] = self.labels_arrs[0][:second_half_start_index, :]
            self.sparse_arrs[0] = [
                feats[:second_half_start_index, :] for feats in self.sparse_arrs[0]
            ]
        elif stage == "test":
            self.dense_arrs[0] = self.dense_arrs[0][second_half_start_index:, :]
            self.labels_arrs[0] = self.labels_arrs[0][second_half_start_index:, :]
            self.sparse_arrs[0] = [
                feats[second_half_start_index:, :] for feats in self.sparse_arrs[0]
            ]

        self.num_rows_per_file: List[int] = list(map(len, self.dense_arrs))
        total_rows = sum(self.num_rows_per_file)
        self.num_full_batches: int = total_rows // batch_size // self.world_size * self.world_size
        self.last_batch_sizes: np.ndarray = np.array([0 for _ in range(self.world_size)])
        remainder = total_rows % (self.world_size * batch_size)
        if not self.drop_last and 0 < remainder:
            if remainder < self.world_size:
                self.num_full_batches -= self.world_size
                self.last_batch_sizes += batch_size
            else:
                self.last_batch_sizes += remainder // self.world_size
            self.last_batch_sizes[: remainder % self.world_size] += 1

        self.multi_hot_sizes: List[int] = [
            multi_hot_feat.shape[-1] for multi_hot_feat in self.sparse_arrs[0]
        ]
        self.keys: List[str] = DEFAULT_CAT_NAMES
        self.index_per_key: Dict[str, int] = {key: i for (i, key) in enumerate(self.keys)}

    def _load_from_npz(self, fname, npy_name):
        # figure out offset of .npy in .npz
        zf = zipfile.ZipFile(fname)
        info = zf.NameToInfo[npy_name]
        assert info.compress_type == 0
        zf.fp.seek(info.header_offset + len(info.FileHeader()) + 20)
        # read .npy header
        zf.open(npy_name, "r")
        version = np.lib.format.read_magic(zf.fp)
        # adapted: numpy 2 has no _read_array_header; the public readers it dispatched to
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(zf.fp)
        else:
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(zf.fp)
        assert dtype == "int32", f"sparse multi-hot dtype is {dtype} but should be int32"
        offset = zf.fp.tell()
        # create memmap
        return np.memmap(
            zf.filename,
            dtype=dtype,
            shape=shape,
            order="F" if fortran_order else "C",
            mode="r",
            offset=offset,
        )

    def _np_arrays_to_batch(
        self,
        dense: np.ndarray,
        sparse: List[np.ndarray],
        labels: np.ndarray,
    ) -> Batch:
        if self.shuffle_batches:
            # Shuffle all 3 in unison
            shuffler = np.random.permutation(len(dense))
            sparse = [multi_hot_ft[shuffler, :] for multi_hot_ft in sparse]
            dense = dense[shuffler]
            labels = labels[shuffler]

        batch_size = len(dense)
        lengths = torch.ones((CAT_FEATURE_COUNT * batch_size), dtype=torch.int32)
        for k, multi_hot_size in enumerate(self.multi_hot_sizes):
            lengths[k * batch_size : (k + 1) * batch_size] = multi_hot_size
        offsets = torch.cumsum(torch.concat((torch.tensor([0]), lengths)), dim=0)
        length_per_key = [batch_size * multi_hot_size for multi_hot_size in self.multi_hot_sizes]
        offset_per_key = torch.cumsum(
            torch.concat((torch.tensor([0]), torch.tensor(length_per_key))), dim=0
        )
        values = torch.concat([torch.from_numpy(feat).flatten() for feat in sparse])
        return Batch(
            dense_features=torch.from_numpy(dense.copy()),
            sparse_features=KeyedJaggedTensor(
                keys=self.keys,
                values=values,
                lengths=lengths,
                offsets=offsets,
                stride=batch_size,
                length_per_key=length_per_key,
                offset_per_key=offset_per_key.tolist(),
                index_per_key=self.index_per_key,
            ),
            labels=torch.from_numpy(labels.reshape(-1).copy()),
        )

    def __iter__(self) -> Iterator[Batch]:
        # Invariant: buffer never contains more than batch_size rows.
        buffer: Optional[List[np.ndarray]] = None

        def append_to_buffer(
            dense: np.ndarray,
            sparse: List[np.ndarray],
            labels: np.ndarray,
        ) -> None:
            nonlocal buffer
            if buffer is None:
                buffer = [dense, sparse, labels]
            else:
                buffer[0] = np.concatenate((buffer[0], dense))
                buffer[1] = [np.concatenate((b, s)) for b, s in zip(buffer[1], sparse)]
                buffer[2] = np.concatenate((buffer[2], labels))

        file_idx = 0
        row_idx = 0
        batch_idx = 0
        buffer_row_count = 0
        cur_batch_size = self.batch_size if self.num_full_batches > 0 else self.last_batch_sizes[0]
        while batch_idx < self.num_full_batches + (self.last_batch_sizes[0] > 0) * self.world_size:
            if buffer_row_count == cur_batch_size or file_idx == len(self.dense_arrs):
                if batch_idx % self.world_size == self.rank:
                    yield self._np_arrays_to_batch(*none_throws(buffer))
                    buffer = None
                buffer_row_count = 0
                batch_idx += 1
                if 0 <= batch_idx - self.num_full_batches < self.world_size and (
                    self.last_batch_sizes[0] > 0
                ):
                    cur_batch_size = self.last_batch_sizes[batch_idx - self.num_full_batches]
            else:
                rows_to_get = min(
                    cur_batch_size - buffer_row_count,
                    self.num_rows_per_file[file_idx] - row_idx,
                )
                buffer_row_count += rows_to_get
                slice_ = slice(row_idx, row_idx + rows_to_get)

                if batch_idx % self.world_size == self.rank:
                    dense_inputs = self.dense_arrs[file_idx][slice_, :]
                    sparse_inputs = [feats[slice_, :] for feats in self.sparse_arrs[file_idx]]
                    target_labels = self.labels_arrs[file_idx][slice_, :]
                    append_to_buffer(dense_inputs, sparse_inputs, target_labels)
                row_idx += rows_to_get

                if row_idx >= self.num_rows_per_file[file_idx]:
                    file_idx += 1
                    row_idx = 0

    def __len__(self) -> int:
        return self.num_full_batches // self.world_size + (self.last_batch_sizes[0] > 0)
